"""The project's exceptions.  Library code raises these; only the CLI turns them into
one-line messages and exit codes (``exit_code`` below, distinct per failure class)."""

from __future__ import annotations


class TrainbpfError(Exception):
    """Base class: a failure the user can act on, worded as one line."""

    exit_code = 1


class NotRootError(TrainbpfError):
    exit_code = 10


class TargetError(TrainbpfError):
    """No such process, or it exited before the probes attached."""

    exit_code = 11


class EnvironmentCheckError(TrainbpfError):
    """tracefs, headers, bcc or a tracepoint is missing: `trainbpf doctor` explains."""

    exit_code = 12


class OutputError(TrainbpfError):
    """The output cannot be written (folder not writable, disk full)."""

    exit_code = 13


class TraceReadError(TrainbpfError):
    """Missing, unreadable, truncated or foreign trace file."""

    exit_code = 14


class TraceSchemaError(TraceReadError):
    """A trainbpf trace of a schema version this build does not read."""

    exit_code = 15


class UsageError(TrainbpfError):
    """An option value that makes no sense (bad window, bad threshold)."""

    exit_code = 2


class JobTracesError(TrainbpfError):
    """Traces given together that are not one job's: of different jobs, the same
    recording twice, a trace without ranks, or the same rank twice."""

    exit_code = 16
