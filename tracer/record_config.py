"""What one recording is asked to do: built once, where the options are read (the CLI,
`trainbpf health`, a test), and passed whole to record() and the Recorder."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from trainbpf.trace.asuser import Invoker
from trainbpf.tracer.settings import Settings


@dataclass(frozen=True)
class RecordConfig:
    pid: int | None  # the process tree's root; None with settings.trace_all: the whole machine
    output: Path
    duration: float | None = None  # seconds; None: until a signal or the target's exit
    settings: Settings = field(default_factory=Settings)
    probes: tuple[str, ...] | None = None  # a subset of the probes; None: all
    gpu: str = "auto"  # auto | nvml | nvidia-smi | off
    topology_file: Path | None = None  # declared topology, overriding /sys
    trainer_tid: int | None = None  # the thread that feeds the GPU
    force: bool = False  # an existing output is replaced
    invoker: Invoker | None = None  # the sudo user, whose rights limit what is traced (tracer/access.py)

    def __post_init__(self) -> None:
        object.__setattr__(self, "output", Path(self.output))
        if self.probes is not None:
            object.__setattr__(self, "probes", tuple(self.probes))
