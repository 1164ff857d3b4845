"""The environment variables that say which rank of a job a process is, declared once
for the recorder (tracer/samplers/jobenv.py: the note and metadata of `record --pid`) and the
analysis (analyzers/job/ranks.py): which variables, in which order they are believed, and
how a value is read as a number."""

from __future__ import annotations

import re
from typing import Mapping

# Each field's variables, strongest first: a launcher's own before the scheduler's, since
# a launcher started by srun has SLURM_PROCID while the ranks it starts have RANK (or
# OMPI_COMM_WORLD_RANK, PMIX_RANK) too.
RANK_VARIABLES: dict[str, tuple[str, ...]] = {
    "rank": ("RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"),
    "local_rank": ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"),
    "world_size": ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"),
}
# What tells one job from another: its processes, and traces of it, share these.
JOB_KEY_VARIABLES = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "MASTER_ADDR", "MASTER_PORT")

_NUMBER = re.compile(r"[0-9]{1,9}")  # ASCII digits, as a launcher writes them (\d takes any script's)


def number(value: object) -> int:
    """A rank variable's value as a number, -1 when it is none."""
    text = str(value).strip()
    return int(text) if _NUMBER.fullmatch(text) else -1


def first_number(env: Mapping[str, str], field: str) -> int | None:
    """The number the strongest of `field`'s variables set in `env` holds, None where
    none holds one."""
    for name in RANK_VARIABLES[field]:
        value = number(env.get(name, ""))
        if value >= 0:
            return value
    return None
