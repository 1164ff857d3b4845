"""The command line: typer commands parse options and forward to keyword-only library
functions.  Only here do the project's exceptions become one-line messages and exit
codes (trainbpf.trace.errors); nothing below prints a traceback for a user's mistake."""

from __future__ import annotations

import enum
import math
import sys
from pathlib import Path
from typing import Callable, Optional

import typer

from trainbpf.analyzers.options import (
    GPU_IDLE_THRESHOLD,
    GPU_IDLE_THRESHOLD_MAX,
    GPU_IDLE_THRESHOLD_MIN,
    ReportFormat,
    Window,
)
from trainbpf.trace.errors import TrainbpfError
from trainbpf.trace.printable import printable, printable_lines
from trainbpf.tracer.settings import GPU_MODES, Settings

# typer (>= 0.29) vendors click; click's usage errors derive from the public TyperException.
ClickException = typer.TyperException
MEMORY_CHECK_HELP = ("Refuse, before reading it, a trace whose analysis would need more memory than is available "
                     "(its row count times ~200 bytes); --no-memory-check tries anyway.")

# Option defaults and choices declared where the recorder declares them.
_RECORDING = Settings()
GpuMode = enum.Enum("GpuMode", {m.replace("-", "_"): m for m in GPU_MODES}, type=str)

app = typer.Typer(
    name="trainbpf",
    help="Find out why a training job's GPUs sit idle: record what its threads wait on "
    "with eBPF, then attribute every stall to a cause.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _fail(exc: TrainbpfError) -> None:
    typer.echo(f"trainbpf: error: {printable(exc)}", err=True)
    raise typer.Exit(exc.exit_code)


def _status_printer() -> Callable[[str], None] | None:
    """A live status line on a terminal; nothing when stderr is a file or pipe."""
    if not sys.stderr.isatty():
        return None

    def show(text: str) -> None:
        sys.stderr.write("\r\033[K" + text)
        sys.stderr.flush()

    return show


class _Command(typer.core.TyperCommand):
    """A command whose usage errors name it (click's parser leaves some without a context,
    and main() points at the command's --help) and exit with `usage_exit`."""

    usage_exit = 2

    def parse_args(self, ctx, args):
        try:
            return super().parse_args(ctx, args)
        except ClickException as exc:
            if exc.exit_code == 2:  # click's UsageError and kin
                exc.ctx = getattr(exc, "ctx", None) or ctx
                exc.exit_code = self.usage_exit
            raise


class _HealthCommand(_Command):
    """`trainbpf health` exits 0-3 by contract, where 2 means critical: a command-line
    mistake must read "could not check" (3), not click's usage-error 2."""

    usage_exit = 3


@app.command(cls=_Command)
def record(
    pid: Optional[int] = typer.Option(None, "--pid", "-p", help="Process to trace (its kernel tgid), with its threads and every descendant."),
    output: Path = typer.Option(Path("trace.parquet"), "--output", "-o", help="Trace file to write (created 0600)."),
    duration: Optional[float] = typer.Option(None, "--duration", "-d", help="Seconds to record; default: until Ctrl-C, SIGTERM or the target exits."),
    min_block_us: float = typer.Option(_RECORDING.min_block_ns / 1000, help="Off-CPU intervals at least this long stream out with stacks; shorter ones are summed in the kernel."),
    min_futex_us: float = typer.Option(_RECORDING.min_futex_ns / 1000, help="Futex waits at least this long are recorded."),
    min_lock_us: float = typer.Option(_RECORDING.min_lock_ns / 1000, help="mmap_lock waits at least this long are recorded."),
    min_cuda_us: float = typer.Option(_RECORDING.min_cuda_ns / 1000, help="CUDA waits, copies and allocations at least this long are recorded (launches are all counted)."),
    oncpu_hz: int = typer.Option(_RECORDING.oncpu_hz, help="On-CPU sampling frequency per CPU."),
    probes: Optional[str] = typer.Option(None, help="Comma-separated probes: sched,futex,faults,oncpu,mm,writeback,block,disk,writepath,net,cuda,nccl (the default set) and the opt-in pagecache; `default` stands for the default set (default,pagecache)."),
    gpu: GpuMode = typer.Option(GpuMode.auto.value, help="GPU sampling: auto (NVML, else nvidia-smi), nvml, nvidia-smi, off."),
    topology: Optional[Path] = typer.Option(None, help='Declared topology JSON {"nodes": {"0": [cpus]}, "gpus": [{"index": 0, "node": 0}]} overriding /sys.'),
    trainer_tid: Optional[int] = typer.Option(None, help="The thread that feeds the GPU (default: the target's main thread)."),
    ringbuf_pages: int = typer.Option(_RECORDING.ringbuf_pages, help="Ring-buffer size per probe in pages (a power of two)."),
    system_wide: bool = typer.Option(False, "--system-wide", help="Trace every thread on the machine instead of one process tree."),
    python_frames: bool = typer.Option(_RECORDING.python_frames, "--python-frames/--no-python-frames", help="Walk CPython 3.10-3.13 frames wherever a user stack is taken, so findings name Python functions and lines."),
    force: bool = typer.Option(False, "--force", help="Replace an existing trace file (never a symlink, a device, or a file the sudo user could not write)."),
) -> None:
    """Record what a training process tree waits on into one trace file (needs root)."""
    from trainbpf.trace.asuser import invoker
    from trainbpf.trace.errors import UsageError
    from trainbpf.tracer.record import record as do_record
    from trainbpf.tracer.record_config import RecordConfig

    try:
        if pid is None and not system_wide:
            raise UsageError("give --pid PID (the training process) or --system-wide")
        if duration is not None and not (math.isfinite(duration) and duration > 0):
            raise UsageError(f"--duration {duration}: must be a positive number of seconds")
        settings = Settings.from_options(  # each option checked against its range (tracer/settings.LIMITS)
            min_block_us=min_block_us, min_futex_us=min_futex_us, min_lock_us=min_lock_us, min_cuda_us=min_cuda_us,
            oncpu_hz=oncpu_hz, ringbuf_pages=ringbuf_pages, trace_all=system_wide, python_frames=python_frames,
        )
        status = _status_printer()
        config = RecordConfig(
            pid=pid, output=output, duration=duration, settings=settings,
            probes=tuple(p.strip() for p in probes.split(",") if p.strip()) if probes else None,
            gpu=gpu.value, topology_file=topology, trainer_tid=trainer_tid, force=force,
            invoker=invoker(),  # under sudo: only the processes that user could ptrace
        )
        result = do_record(config=config, status=status,
                           notice=lambda line: typer.echo(("\n" if status else "") + printable(line), err=True))
    except TrainbpfError as exc:
        if sys.stderr.isatty():
            sys.stderr.write("\n")
        _fail(exc)
    if sys.stderr.isatty():
        sys.stderr.write("\n")
    lost = sum(result.lost.values())
    typer.echo(
        f"wrote {result.output} ({result.bytes / 1e6:.1f} MB): {result.duration_s:.1f} s, "
        f"{result.rows} rows, {result.threads} threads, lost {lost}, GPU samples from "
        f"{result.gpu_source or 'nowhere (no nvidia-smi/NVML)'}; stopped: {result.stop_reason}",
        err=True,
    )
    if result.cuda_libraries == 0 and "cuda" in result.probes:
        typer.echo("cuda: no CUDA library (libcudart/libcuda) was mapped by the traced processes", err=True)
    if result.nccl_libraries == 0 and "nccl" in result.probes:
        typer.echo("nccl: no NCCL library (libnccl) was mapped by the traced processes", err=True)
    if lost:
        typer.echo(f"trainbpf: warning: {lost} events lost ({result.lost}); "
                   "try a larger --ringbuf-pages or higher thresholds", err=True)


@app.command(cls=_Command)
def doctor(
    no_load: bool = typer.Option(False, "--no-load", help="Skip compiling and loading the probes."),
    pid: Optional[int] = typer.Option(None, "--pid", "-p", help="Also list the CUDA libraries each process of this process's tree maps, and the probed symbols they export."),
) -> None:
    """Check that this machine can record, with a fix for everything that is missing."""
    from trainbpf.doctor import cuda_report, render, run_checks
    from trainbpf.tracer.preflight import FAIL

    try:
        cuda = cuda_report(pid) if pid is not None else None
    except TrainbpfError as exc:
        _fail(exc)
    checks = run_checks(load_probes=not no_load)
    typer.echo(render(checks))
    if cuda is not None:
        typer.echo("\n" + printable_lines(cuda))
    if any(c.status == FAIL for c in checks):
        raise typer.Exit(12)


@app.command(cls=_Command)
def analyze(
    trace: list[Path] = typer.Argument(..., help="trace.parquet written by `trainbpf record`; several: one job's traces, one per node, analysed as one job."),
    format: ReportFormat = typer.Option(ReportFormat.text, "--format", "-f", help="What to write: the terminal text, the JSON contract, or one HTML file (one trace)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Write the report here instead of stdout."),
    trainer_tid: Optional[int] = typer.Option(None, help="The thread that feeds the GPU (default: recorded or the target's main thread; one trace)."),
    gpu_idle_threshold: float = typer.Option(
        GPU_IDLE_THRESHOLD, min=GPU_IDLE_THRESHOLD_MIN, max=GPU_IDLE_THRESHOLD_MAX,
        help="Shade GPU samples below this utilisation percent in the HTML timeline (drawing only: starved time uses each sample's own utilisation)."),
    window: Optional[str] = typer.Option(None, help="START:END seconds from the trace start to analyse (one trace)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing -o file (never a symlink, a device, or a file the sudo user could not write)."),
    memory_check: bool = typer.Option(True, "--memory-check/--no-memory-check", help=MEMORY_CHECK_HELP),
    resolve: bool = typer.Option(False, "--resolve", help="Look up the host names of network peers (reverse DNS, a few seconds at most; one trace). Off by default: the report names addresses."),
) -> None:
    """Attribute every stall of the trainer's threads to a cause; rank the findings (no root)."""
    try:
        if len(trace) > 1:
            if resolve:
                from trainbpf.trace.errors import UsageError

                raise UsageError("--resolve applies to one trace")
            text = _analyze_traces(trace, format, output, trainer_tid, window, force, memory_check)
        else:
            from trainbpf.reports.render import run_analyze

            text = run_analyze(
                path=trace[0], fmt=format, output=output, trainer_tid=trainer_tid,
                gpu_idle_threshold=gpu_idle_threshold, window=Window.parse(window), force=force, memory_check=memory_check,
                resolve=resolve,
            )
    except TrainbpfError as exc:
        _fail(exc)
    if output is None:
        typer.echo(text, nl=not text.endswith("\n"))
    else:
        typer.echo(f"wrote {output}", err=True)


# Several traces: progress lines on a pipe only for this many traces or more.
PROGRESS_MIN_TRACES = 8


def _analyze_traces(traces: list[Path], fmt: ReportFormat, output: Optional[Path], trainer_tid: Optional[int],
                    window: Optional[str], force: bool, memory_check: bool) -> str:
    """`analyze` of several traces of one job: progress and clock warnings on stderr (the GPU
    idle threshold only shades the one-trace HTML: nothing here draws)."""
    from trainbpf.reports.traces import run_analyze_traces
    from trainbpf.trace.errors import UsageError

    for name, value in (("--trainer-tid", trainer_tid), ("--window", window)):
        if value is not None:
            raise UsageError(f"{name} applies to one trace; several traces are analysed whole, every rank a trainer")
    status = _status_printer()
    shown = []  # a live status line left open

    def progress(done: int, total: int) -> None:
        line = f"analysed {done}/{total} traces"
        if status is not None:
            status(line)
            shown[:] = [done < total]
            if done == total:
                sys.stderr.write("\n")
        elif total >= PROGRESS_MIN_TRACES and (done == total or done % max(1, total // 10) == 0):
            typer.echo(line, err=True)

    try:
        text, notes = run_analyze_traces(paths=traces, fmt=fmt, output=output, force=force,
                                         memory_check=memory_check, progress=progress)
    finally:
        if any(shown):
            sys.stderr.write("\n")
    for note in notes:
        typer.echo(f"trainbpf: warning: {printable(note)}", err=True)
    return text


@app.command(cls=_Command)
def export(
    trace: Path = typer.Argument(..., help="trace.parquet to export."),
    output: Path = typer.Option(Path("trace.json"), "--output", "-o", help="Chrome trace-event JSON to write, for ui.perfetto.dev."),
    force: bool = typer.Option(False, "--force", help="Replace an existing -o file (never a symlink, a device, or a file the sudo user could not write)."),
    memory_check: bool = typer.Option(True, "--memory-check/--no-memory-check", help=MEMORY_CHECK_HELP),
) -> None:
    """Export a trace as a timeline that ui.perfetto.dev opens."""
    from trainbpf.reports.perfetto import run_export

    try:
        path = run_export(path=trace, output=output, force=force, memory_check=memory_check)
    except TrainbpfError as exc:
        _fail(exc)
    typer.echo(f"wrote {path}", err=True)


@app.command(cls=_Command)
def recover(
    spool: Path = typer.Argument(..., help="The .spool file a recorder left behind."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Parquet file to write (default: the spool's name without .spool)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing trace file (never a symlink, a device, or a file the sudo user could not write)."),
) -> None:
    """Turn the spool of an interrupted recording into a trace file."""
    from trainbpf.trace.spool import recover as do_recover

    try:
        path = do_recover(spool, output, force=force)
    except TrainbpfError as exc:
        _fail(exc)
    typer.echo(f"wrote {path}", err=True)


@app.command(cls=_HealthCommand)
def health(
    duration: Optional[float] = typer.Option(None, "--duration", "-d", help="Seconds to record (default: the config file's duration_s; docs/health.md lists every default)."),
    pid: Optional[list[int]] = typer.Option(None, "--pid", "-p", help="Training process to check (kernel tgid); repeat for several. Default: auto-detect."),
    textfile_dir: Optional[Path] = typer.Option(None, "--textfile-dir", help="node_exporter textfile folder to write trainbpf_health.prom into."),
    json_file: Optional[Path] = typer.Option(None, "--json", help="Write the run's JSON document here (for `trainbpf fleet`)."),
    config: Optional[Path] = typer.Option(None, "--config", help="TOML config (default: the system-wide one, when present); see docs/health.md."),
) -> None:
    """Scheduled node health check: short record + analyze; exit 0 ok, 1 warning, 2 critical, 3 could not check."""
    from trainbpf.health.config import UNKNOWN, health_config
    from trainbpf.health.outputs import render_summary
    from trainbpf.health.run import run_health

    try:
        result = run_health(config=health_config(
            config_file=config, duration=duration, pids=pid, textfile_dir=textfile_dir, json_file=json_file))
    except TrainbpfError as exc:
        typer.echo(f"trainbpf: error: {printable(exc)}", err=True)
        raise typer.Exit(UNKNOWN)
    typer.echo(printable_lines(render_summary(result)))
    if result.error:
        typer.echo(f"trainbpf: error: {printable(result.error)}", err=True)
    raise typer.Exit(result.exit_code)


@app.command(cls=_Command)
def fleet(
    source: str = typer.Argument(..., help="Folder of health JSON documents (searched recursively) or a glob."),
    format: str = typer.Option("text", "--format", "-f", help="text, json or csv."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Write the table here instead of stdout."),
    force: bool = typer.Option(False, "--force", help="Replace an existing -o file (never a symlink, a device, or a file the sudo user could not write)."),
) -> None:
    """Merge many nodes' `trainbpf health --json` documents into one table ranked by starved share."""
    from trainbpf.fleet import run_fleet

    try:
        text, skipped = run_fleet(source=source, fmt=format, output=output, force=force)
    except TrainbpfError as exc:
        _fail(exc)
    for line in skipped:
        typer.echo(f"trainbpf: warning: skipped {printable(line)}", err=True)
    if output is None:
        typer.echo(text, nl=False)
    else:
        typer.echo(f"wrote {output}", err=True)


def _usage_line(exc: ClickException) -> str:
    """click's usage error (usage line, hint, boxed message) as one line."""
    text = " ".join(exc.format_message().split()).rstrip(".")
    ctx = getattr(exc, "ctx", None)
    return f"trainbpf: error: {printable(text)} (see '{ctx.command_path if ctx else 'trainbpf'} --help')"


def main() -> None:
    """Run the app without click's standalone mode, so that its usage errors become the
    project's one line on stderr (exit 2; `health` makes it 3) instead of a box."""
    try:
        code = app(standalone_mode=False)  # an int from typer.Exit/--help, else None
    except ClickException as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # bare `trainbpf`: help, as before
            if exc.message.strip():  # rich has printed it already; plain click has not
                typer.echo(exc.message)
        else:
            typer.echo(_usage_line(exc), err=True)
        code = exc.exit_code
    except typer.Abort:
        typer.echo("trainbpf: aborted", err=True)
        code = 1
    except KeyboardInterrupt:
        typer.echo("trainbpf: interrupted", err=True)
        code = 130
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
