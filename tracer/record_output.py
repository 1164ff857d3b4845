"""What `trainbpf record` writes: its output, checked and opened before anything is
compiled, and the result it reports."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from trainbpf.trace.safefile import OutputFile, check_output as safe_check_output
from trainbpf.trace.spool import check_spool_free, spool_path_for


@dataclass
class RecordResult:
    output: Path
    duration_s: float
    rows: int
    lost: dict[str, int]
    stop_reason: str
    threads: int
    gpu_source: str | None
    bytes: int
    probes: tuple[str, ...] = ()
    cuda_libraries: int = 0  # CUDA library files probed
    nccl_libraries: int = 0  # NCCL library files probed

    @classmethod
    def of(cls, output: Path, final: dict, *, duration_s: float, rows: int, threads: int, size: int) -> RecordResult:
        """The result of a recording written to `output`, whose metadata is `final`."""
        libraries = {probe: len(final.get(probe, {}).get("libraries", ())) for probe in ("cuda", "nccl")}
        return cls(output, duration_s, rows, final["lost"], final["stop_reason"], threads,
                   final.get("gpu", {}).get("source"), size, tuple(final.get("probes", ())),
                   cuda_libraries=libraries["cuda"], nccl_libraries=libraries["nccl"])


def check_output(output: Path, *, force: bool = False, notice: Callable[[str], None] | None = None) -> OutputFile:
    """Before anything is compiled: the output may be written (safefile.check_output),
    and its spool is neither another recorder's nor an unrecovered recording (an empty
    one is removed, said through `notice`).  Returns the output's folder, opened once."""
    out = safe_check_output(output, force=force)
    try:
        if check_spool_free(out) and notice:
            notice(f"removed the empty spool {spool_path_for(output)} (its recorder stopped before writing anything)")
    except BaseException:
        out.close()
        raise
    return out
