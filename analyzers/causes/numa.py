"""Where threads ran and memory sat, relative to the GPU's NUMA node."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import pandas as pd

from trainbpf.analyzers.intervals import as_int64

# A producer counts as remote when most of its on-CPU samples fall on other nodes.
REMOTE_MIN_FRACTION = 0.5
PLACEMENT_COLUMNS = ("tid", "samples", "remote_samples", "remote_fraction", "main_node", "moves")


def cpu_nodes(topology: Mapping[str, Any] | None) -> dict[int, int]:
    """cpu -> NUMA node from the trace's topology ({"nodes": {"0": [0, 1], ...}})."""
    out: dict[int, int] = {}
    for node, cpus in ((topology or {}).get("nodes") or {}).items():
        try:
            for cpu in cpus or []:
                out[int(cpu)] = int(node)
        except (TypeError, ValueError):
            continue
    return out


def gpu_node(topology: Mapping[str, Any] | None) -> int | None:
    node = (topology or {}).get("gpu_node")
    try:
        return None if node is None else int(node)
    except (TypeError, ValueError):
        return None


def numa_applies(topology: Mapping[str, Any] | None) -> bool:
    """Remote placement means something only with several nodes and a known GPU node."""
    nodes = set(cpu_nodes(topology).values())
    return gpu_node(topology) is not None and len(nodes) > 1


def thread_placement(samples: pd.DataFrame, numa_move: pd.DataFrame, topology: Mapping[str, Any] | None) -> pd.DataFrame:
    """Per thread: on-CPU samples, how many ran on a node other than the GPU's, the node
    it ran on most, and scheduler NUMA moves.  Empty when NUMA does not apply."""
    empty = pd.DataFrame({
        "tid": np.zeros(0, np.int64), "samples": np.zeros(0, np.int64), "remote_samples": np.zeros(0, np.int64),
        "remote_fraction": np.zeros(0, np.float64), "main_node": np.zeros(0, np.int64), "moves": np.zeros(0, np.int64),
    })
    if not numa_applies(topology):
        return empty
    mapping = cpu_nodes(topology)
    home = gpu_node(topology)
    lut = np.full(max(mapping) + 2, -1, dtype=np.int64)
    lut[list(mapping)] = list(mapping.values())
    cpu = samples["cpu"].to_numpy(np.int64)
    node = np.where((cpu >= 0) & (cpu < len(lut)), lut[np.clip(cpu, 0, len(lut) - 1)], -1)
    df = pd.DataFrame({"tid": samples["tid"].to_numpy(np.int64), "node": node})
    df = df[df["node"] >= 0]
    # Without samples, where the scheduler moved a thread to says where it ran.
    moves = pd.DataFrame({"tid": as_int64(numa_move["tid"]), "node": as_int64(numa_move["dst_node"])})
    move_counts = moves.groupby("tid").size()
    unsampled = moves[~moves["tid"].isin(df["tid"])]
    df = pd.concat([df, unsampled], ignore_index=True)
    if not len(df):
        return empty
    df["remote"] = df["node"] != home
    per = df.groupby("tid").agg(samples=("node", "size"), remote_samples=("remote", "sum"))
    by_node = df.groupby(["tid", "node"]).size().rename("n").reset_index().sort_values("n", kind="stable")
    per["main_node"] = by_node.drop_duplicates("tid", keep="last").set_index("tid")["node"]
    per["remote_fraction"] = per["remote_samples"] / per["samples"]
    per["moves"] = move_counts.reindex(per.index).fillna(0)
    per = per.reset_index()
    return pd.DataFrame({
        "tid": per["tid"].to_numpy(np.int64), "samples": per["samples"].to_numpy(np.int64),
        "remote_samples": per["remote_samples"].to_numpy(np.int64),
        "remote_fraction": per["remote_fraction"].to_numpy(np.float64),
        "main_node": per["main_node"].to_numpy(np.int64), "moves": per["moves"].to_numpy(np.int64),
    })[list(PLACEMENT_COLUMNS)]


def memory_placement(numa_maps: pd.DataFrame, topology: Mapping[str, Any] | None) -> dict[int, int]:
    """Pages per node of the target at the end of the recording (or the latest snapshot)."""
    if not len(numa_maps) or not numa_applies(topology):
        return {}
    df = pd.DataFrame({
        "ts": as_int64(numa_maps["ts_ns"]), "state": numa_maps["state"].fillna("").astype(str).to_numpy(dtype=object),
        "node": as_int64(numa_maps["node"]), "count": as_int64(numa_maps["pages"], 0),
    })
    latest = df[df["ts"] == df["ts"].max()]
    return {int(n): int(c) for n, c in latest.groupby("node")["count"].sum().items() if n >= 0}
