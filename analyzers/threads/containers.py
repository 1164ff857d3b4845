"""Which container each traced process ran in (`container` rows: one field per row, as
tracer/samplers/containers.py read the process's cgroup path)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from trainbpf.analyzers.intervals import as_int64

FIELDS = ("id", "runtime", "pod_uid", "cgroup")
CONTAINER_COLUMNS = ("pid",) + FIELDS


def process_containers(rows: pd.DataFrame) -> pd.DataFrame:
    """CONTAINER_COLUMNS per pid in a container, from its newest read ("" for a field the
    cgroup path did not show); no row for a process in none."""
    if not len(rows):
        return pd.DataFrame({"pid": np.zeros(0, np.int64), **{f: pd.Series([], dtype=object) for f in FIELDS}})
    rows = pd.DataFrame({"pid": as_int64(rows["pid"]), "ts_ns": as_int64(rows["ts_ns"]),
                         "field": rows["field"].astype(str), "value": rows["value"].astype(str)})
    newest = rows[rows["ts_ns"] == rows.groupby("pid")["ts_ns"].transform("max")]
    table = newest.drop_duplicates(["pid", "field"], keep="last").pivot(index="pid", columns="field", values="value")
    out = pd.DataFrame({"pid": table.index.to_numpy(np.int64)})
    for f in FIELDS:
        out[f] = (table[f].fillna("") if f in table else pd.Series("", index=table.index)).to_numpy(dtype=object)
    return out


def container_of(containers: pd.DataFrame, pid: int | None) -> dict[str, Any] | None:
    """The report's `container` of process `pid`: {id, runtime, pod_uid, cgroup} (null
    where the path did not show one), None when it ran in none."""
    row = containers[containers["pid"] == pid] if pid is not None else containers.iloc[:0]
    if not len(row):
        return None
    first = row.iloc[0]
    return {f: (str(first[f]) or None) for f in FIELDS}
