"""Where threads ran and memory sat, relative to the GPU's NUMA node."""

from __future__ import annotations

from typing import Any, Callable, Mapping

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


# Copies to the GPU count as remote when at least this share of their host bytes came
# from pages on other nodes.
COPY_REMOTE_MIN_SHARE = 0.5


def allowed_cpus(cpus: str) -> set[int]:
    """A Cpus_allowed_list ("0-3,8") as a set; empty when unreadable."""
    out: set[int] = set()
    for part in (cpus or "").split(","):
        lo, _, hi = part.strip().partition("-")
        if lo.isdigit() and (not hi or hi.isdigit()):
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _copier(tid: int, nbytes: int, affinity: pd.DataFrame, placement: pd.DataFrame, topology) -> dict[str, Any]:
    """A copying thread: its bytes, affinity (restricted or not) and the node it ran on:
    the placement's main node, else the one node its allowed CPUs lie on, else None."""
    mine = affinity[as_int64(affinity["tid"]) == tid]
    cpus = str(mine["cpus"].iloc[-1]) if len(mine) else ""
    mems = str(mine["mems"].iloc[-1]) if len(mine) else ""
    mapping = cpu_nodes(topology)
    allowed = allowed_cpus(cpus)
    placed = placement[placement["tid"] == tid] if len(placement) else placement
    nodes_allowed = {mapping[c] for c in allowed if c in mapping}
    ran_on = int(placed["main_node"].iloc[0]) if len(placed) else (nodes_allowed.pop() if len(nodes_allowed) == 1 else None)
    return {"tid": tid, "bytes": nbytes, "cpus": cpus, "mems": mems,
            "restricted": bool(allowed) and bool(mapping) and not set(mapping) <= allowed, "ran_on_node": ran_on}


def copy_sources(copy_node: pd.DataFrame, affinity: pd.DataFrame, placement: pd.DataFrame,
                 topology: Mapping[str, Any] | None, start_ns: int, end_ns: int) -> dict[str, Any] | None:
    """Where the bytes copied to the GPU in [start_ns, end_ns) came from (copy_node rows):
    host bytes per source node, the share from nodes other than the GPU's (None when the
    GPU's node is unknown), bytes from device memory and not asked about, and the
    copying threads (most bytes first).  None when no copy was seen."""
    ts = as_int64(copy_node["ts_ns"])
    rows = copy_node[(ts >= start_ns) & (ts < end_ns)]
    if not len(rows):
        return None
    source = rows["source"].astype(str).to_numpy()
    nbytes = as_int64(rows["bytes"], 0)
    node = as_int64(rows["node"], -1)
    host = source == "host"
    by_node = pd.Series(nbytes[host]).groupby(node[host]).sum()
    copied = int(nbytes[host].sum())
    home = gpu_node(topology)
    remote = int(by_node[by_node.index != home].sum()) if home is not None else None
    per_thread = pd.Series(nbytes[host]).groupby(as_int64(rows["tid"])[host]).sum().sort_values(ascending=False)
    return {
        "gpu_node": home,
        "copied_bytes": copied,
        "bytes_by_node": {str(int(n)): int(b) for n, b in by_node.items()},
        "remote_bytes": remote,
        "remote_share": remote / copied if remote is not None and copied else None,
        "device_source_bytes": int(nbytes[source == "not_host"].sum()),
        "unknown_bytes": int(nbytes[source == "unknown"].sum()),
        "policies": sorted({str(p) for p in rows.loc[host, "policy"].dropna() if str(p)}),
        "threads": [_copier(int(t), int(b), affinity, placement, topology) for t, b in per_thread.items()],
    }


def copies_remote(copies: Mapping[str, Any] | None) -> bool:
    share = (copies or {}).get("remote_share")
    return share is not None and share >= COPY_REMOTE_MIN_SHARE


def copy_case(copies: Mapping[str, Any] | None, topology: Mapping[str, Any] | None,
              thread: Callable[[int], Mapping[str, Any]]) -> dict[str, Any]:
    """The numa_remote case of copies mostly from remote pages: `case` and the `names`
    its sentences quote ({} when the copies are not remote).  `thread`: tid -> {comm}."""
    if not copies_remote(copies):
        return {}
    home = copies["gpu_node"]
    gpus = [g for g in (topology or {}).get("gpus") or [] if g.get("node") == home]
    remote_nodes = sorted(n for n in copies["bytes_by_node"] if int(n) != home)
    said = []
    for t in copies["threads"][:3]:
        ran = "had" if t["ran_on_node"] is None else f"ran on node {t['ran_on_node']} with"
        bound = f"affinity to CPUs {t['cpus']}" if t["restricted"] else "no affinity"
        said.append(f"{thread(t['tid']).get('comm') or '?'} ({t['tid']}) {ran} {bound}")
    return {"case": "remote_copies", "names": {
        "remote_pct": f"{copies['remote_share']:.0%}", "copied_bytes": copies["copied_bytes"],
        "gpu": str(gpus[0]["index"]) if gpus else "?", "gpu_node": home,
        "source_nodes": "node " + ", ".join(remote_nodes) if len(remote_nodes) == 1 else "nodes " + ", ".join(remote_nodes),
        "copiers": "; ".join(said) or "no copying thread is known"}}
