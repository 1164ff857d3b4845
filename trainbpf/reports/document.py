"""The report layer's numbers: the JSON contract (docs/design.md §Trace contract) and
the sentences of the findings (from the category registry, analyzers/causes/categories.py).
Every renderer takes one `Report`: the analysis and its JSON document, built once
(`render_json` here; reports/text.py and reports/html.py import this module, never the
reverse; trainbpf/reports/render.py picks one and writes its output)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import pandas as pd

from trainbpf.analyzers.causes.categories import BY_NAME
from trainbpf.analyzers.causes.files import file_name
from trainbpf.analyzers.causes.huge_pages import PAGE_COLUMNS
from trainbpf.analyzers.causes.tlb import CALL_COLUMNS, CHARGE_COLUMNS, shootdown_evidence
from trainbpf.analyzers.causes.page_cache import refault_names
from trainbpf.analyzers.intervals import NS_PER_S
from trainbpf.analyzers.pipeline import Analysis
from trainbpf.analyzers.threads.containers import container_of
from trainbpf.analyzers.threads.states import state_seconds
from trainbpf.analyzers.vocab import ROLES
from trainbpf.reports.buffers import buffer_culprits, buffers_section
from trainbpf.reports.job import job_summary, rank_culprits, ranks_section, straggler_section
from trainbpf.reports.network import network_culprits, thread_network
from trainbpf.reports.present import size
from trainbpf.reports.python_frames import frame_label

REPORT_SCHEMA = "trainbpf.report/3"
# Other tasks' I/O, and files written back, named as a disk finding's culprits from this
# share of the device's bytes during its waits.
MIN_ISSUER_SHARE = 0.05
_ROLE_ORDER = {role: i for i, role in enumerate(ROLES)}


def plain(obj: Any) -> Any:
    """JSON-safe plain Python values: numpy scalars unwrapped, floats to 6 decimals,
    NaN/inf as null."""
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, np.ndarray)):
        return [plain(v) for v in obj]
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        value = float(obj)
        return round(value, 6) if math.isfinite(value) else None
    if obj is None or isinstance(obj, str):
        return obj
    return str(obj)


def _share(value: float) -> float:
    """Shares rounded down, so rounding never lifts their sum above 1."""
    return math.floor(float(value) * 1e6) / 1e6


def _seconds(value: float) -> float:
    return round(float(value), 6)


def findings_section(findings: Any, *, pids: Mapping[int, int], trainers: Mapping[int, int],
                     trainer_tid: int | None) -> list[dict[str, Any]]:
    """The report's `findings` (findings.FINDING_COLUMNS rows), largest share first.
    `pids`: tid -> pid where a finding's threads do not carry theirs; `trainers`: rank ->
    its trainer's tid, in a job (a finding's trainer is its rank's), else `trainer_tid`."""
    out = []
    for f in findings.itertuples(index=False):
        trainer = trainers.get(f.evidence["rank"], trainer_tid) if "rank" in f.evidence else trainer_tid
        out.append({
            "category": str(f.category),
            "share": _share(f.share),
            "seconds": _seconds(f.seconds),
            "severity": str(f.severity),
            "threads": [{"tid": int(t["tid"]), "comm": str(t["comm"]), "role": str(t["role"])} for t in f.threads],
            "chain": [{"tid": int(c["tid"]), "role": str(c["role"]), "state": str(c["state"]),
                       **({"rank": int(c["rank"])} if "rank" in c else {})} for c in f.chain],
            "culprits": culprits(str(f.category), f.threads, f.evidence, pids=pids, trainer_tid=trainer),
            "summary": job_summary(f.evidence, f.share, f.seconds, finding_summary(
                str(f.category), f.share, f.seconds, f.threads, f.evidence,
                own_seconds=_own_seconds(f.evidence, f.seconds))),
            "evidence": plain(f.evidence),
            "recommendation": recommendation(str(f.category), f.evidence),
            "launch_gap_s": None if math.isnan(f.launch_gap_s) else _seconds(f.launch_gap_s),
        })
    return sorted(out, key=lambda f: (-f["share"], -f["seconds"]))


def build_report(analysis: Analysis) -> dict[str, Any]:
    """The `--format json` document, exactly the contract (docs/design.md §Trace contract)."""
    job = analysis.job
    findings = findings_section(
        analysis.findings, pids=dict(zip(analysis.threads["tid"].tolist(), analysis.threads["pid"].tolist())),
        trainers=dict(zip(job.ranks["rank"].tolist(), job.ranks["trainer_tid"].tolist())) if job else {},
        trainer_tid=analysis.trainer_tid)
    seconds = state_seconds(analysis.totals)
    threads = analysis.threads.assign(order=analysis.threads["role"].astype(str).map(_ROLE_ORDER))
    rows = []
    traffic = thread_network(analysis.traffic)
    for th in threads.sort_values(["order", "tid"], kind="stable").itertuples(index=False):
        rows.append({
            "tid": int(th.tid), "comm": str(th.comm), "role": str(th.role),
            "seconds": {k: _seconds(v) for k, v in seconds.get(int(th.tid), {}).items()},
            **({"network": traffic[int(th.tid)]} if int(th.tid) in traffic else {}),
        })
    pid = analysis.meta.get("target_pid")
    return {
        "schema": REPORT_SCHEMA,
        "trace": {
            "path": analysis.path,
            "duration_s": _seconds(analysis.window.seconds),
            "pid": int(pid) if pid is not None else None,
            "lost_events": int(sum(analysis.lost.values())),
        },
        "gpu": {
            "source": analysis.gpu_source,
            "samples": analysis.gpu_samples,
            "idle_fraction": None if analysis.idle_fraction is None else _seconds(analysis.idle_fraction),
        },
        "starved_s": _seconds(analysis.starved_ns / NS_PER_S),
        "host_bound_s": _seconds(analysis.host_bound_ns / NS_PER_S),
        "ranks": ranks_section(job),
        "straggler": straggler_section(job),
        "findings": findings,
        "threads": rows,
        "cuda": cuda_section(analysis),
        "traces": None,
        "container": None if analysis.containers is None else container_of(analysis.containers, pid),
        "memory": memory_section(analysis),
        "buffers": buffers_section(analysis.lifetimes, analysis.held_frees),
        "numa": numa_section(analysis.copies),
    }


def numa_section(copies: dict[str, Any] | None) -> dict[str, Any] | None:
    """The report's `numa` section: the bytes copied to the GPU per source page node
    (analyzers/causes/numa.py copy_sources); None when no copy's source was looked up."""
    if copies is None:
        return None
    share = copies["remote_share"]
    return {**copies, "remote_share": None if share is None else round(float(share), 4)}


def memory_section(analysis: Analysis) -> dict[str, Any]:
    """The report's `memory` section: the THP mode and counters, and each process's
    faults per MiB newly mapped (analyzers/causes/huge_pages.py)."""
    pages = analysis.pages if analysis.pages is not None else pd.DataFrame(columns=list(PAGE_COLUMNS))
    charges = analysis.shootdowns if analysis.shootdowns is not None else pd.DataFrame(columns=list(CHARGE_COLUMNS))
    names = dict(zip(analysis.threads["tid"].tolist(), analysis.threads["comm"].astype(str).tolist()))
    mm_calls = analysis.mm_calls if analysis.mm_calls is not None else pd.DataFrame(columns=list(CALL_COLUMNS))
    return {
        "thp": dict(analysis.thp or {"enabled": None, "defrag": None}),
        "processes": [{"pid": int(r.pid), "mapped_bytes": int(r.mapped_bytes), "faults": int(r.faults),
                       "faults_per_mib": round(float(r.faults_per_mib), 2), "huge_pages": bool(r.huge_pages),
                       "faults_with_huge_pages": int(r.faults_with_huge_pages)} for r in pages.itertuples(index=False)],
        "tlb_shootdowns": [{"tid": int(tid), "comm": names.get(int(tid), ""),
                            **shootdown_evidence(charges, [int(tid)], names, mm_calls)["tlb_shootdowns"]}
                           for tid in sorted(set(charges.loc[charges["shootdowns"] > 0, "tid"].tolist()))],
    }



def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else _seconds(seconds * 1e3)


def cuda_section(analysis: Analysis) -> dict[str, Any] | None:
    """The report's `cuda` section (docs/design.md, "The JSON report"): the trainer's
    GPU-bound and launch-gap seconds and step rhythm, and each CUDA thread's launches and
    waits over the window; None when the trace holds no CUDA rows."""
    cuda = analysis.cuda
    if cuda is None:
        return None
    comm = dict(zip(analysis.threads["tid"].tolist(), analysis.threads["comm"].astype(str).tolist()))
    th = cuda.threads
    st = analysis.cuda_steps or {}
    origin = analysis.span.start_ns
    return {
        "gpu_bound_s": _seconds(analysis.gpu_bound_ns / NS_PER_S),
        "launch_gap_s": _seconds(th.loc[th["tid"] == analysis.trainer_tid, "gap_ns"].sum() / NS_PER_S),
        "steps": {
            "count": int(st.get("steps", 0)),
            "per_s": _seconds(st.get("steps_per_s", 0.0)),
            "p50_ms": _ms(st.get("step_p50_s")),
            "p99_ms": _ms(st.get("step_p99_s")),
            "host_bound_share": None if st.get("host_bound_share") is None else _seconds(st["host_bound_share"]),
            "worst": [{"tid": int(w["tid"]), "at_s": _seconds((w["start_ns"] - origin) / NS_PER_S),
                       "step_ms": _ms(w["step_s"]), "host_ms": _ms(w["host_s"]), "gpu_wait_ms": _ms(w["gpu_wait_s"]),
                       "host_share": _seconds(w["host_share"])} for w in st.get("worst", [])],
        },
        "threads": [{"tid": int(r.tid), "comm": comm.get(int(r.tid), ""), "launches": int(r.launches),
                     "waits": int(r.waits), "wait_s": _seconds(r.wait_ns / NS_PER_S),
                     "launch_gap_s": _seconds(r.gap_ns / NS_PER_S)} for r in th.itertuples(index=False)],
    }


def culprits(category: str, threads: list[dict[str, Any]], evidence: dict[str, Any], *,
             pids: Mapping[int, int], trainer_tid: int | None) -> list[dict[str, Any]]:
    """What the finding blames (docs/findings.md, "Outputs"): its threads, as producers
    ({kind: "thread", name, tid, pid}: a thread's own `pid`, else `pids`'); for the
    trainer's host work with the seconds of it and the function that took most of them;
    the tasks that preempted them ({kind: "process"}); in a job, the ranks its time was
    spent on."""
    own = evidence.get("trainer_loading") if category == "input_pipeline" else evidence
    producers = {int(p["tid"]): float(p["seconds"]) for p in evidence.get("producers", [])}
    out = []
    for t in threads:
        tid = int(t["tid"])
        row: dict[str, Any] = {"kind": "thread", "name": str(t["comm"]), "tid": tid, "pid": t.get("pid", pids.get(tid))}
        if tid in producers:
            row["seconds"] = _seconds(producers[tid])
        if tid == trainer_tid and own and own.get("functions"):
            row["function"] = _function_label(own["functions"][0])
            row.setdefault("seconds", _seconds(sum(f["seconds"] for f in own["functions"])))
        out.append(row)
    return buffer_culprits(out, evidence, pids) + (
        _preempting(evidence) + _lock_culprits(evidence, pids) + _io_culprits(evidence)
        + _memory_culprits(evidence) + _shootdown_senders(evidence) + network_culprits(evidence)
        + rank_culprits(evidence))


def _shootdown_senders(evidence: dict[str, Any]) -> list[dict[str, Any]]:
    """A memory finding's threads whose unmaps sent the TLB shootdowns that interrupted
    the trainer (its evidence's `tlb_shootdowns`), each with the shootdowns charged."""
    return [{"kind": "thread", "name": s["comm"], "tid": s["tid"], "pid": s["pid"], "shootdown_sender": True,
             "count": s["shootdowns"]} for s in (evidence.get("tlb_shootdowns") or {}).get("senders", [])]


def _memory_culprits(evidence: dict[str, Any]) -> list[dict[str, Any]]:
    """A reclaim finding's memory cgroup (its limit and what it held) and the files
    whose pages filled it, each with its dirtier (its evidence's `cgroup` and
    `page_cache`, analyzers/causes/page_cache.py)."""
    cgroup = evidence.get("cgroup")
    if not cgroup:
        return []
    out: list[dict[str, Any]] = [{"kind": "cgroup", "name": cgroup["path"], **{
        f"{key}_bytes" if key != "max" else "limit_bytes": int(cgroup[key])
        for key in ("max", "usage", "file", "anon") if key in cgroup}}]
    named: set[int] = set()
    for f in evidence.get("page_cache", []):
        amounts = {k: f[k] for k in ("added_bytes", "dirtied_bytes") if f[k]}
        out += [_file_culprit(f, **amounts)] + _dirtier_culprit(f, named)
    return out


def _io_culprits(evidence: dict[str, Any]) -> list[dict[str, Any]]:
    """A disk finding's device, the files written back (or dirtied) during its waits
    and who dirtied them, the file read again and the one that pushed it out of the page
    cache, and the other tasks whose requests filled the device (its evidence's `io`,
    analyzers/causes/io_culprits.py)."""
    io = evidence.get("io")
    if not io:
        return []
    out: list[dict[str, Any]] = [{"kind": "device", "name": d["name"], "device": d["device"],
                                  "bytes": int(io["bytes"])} for d in io["devices"][:1]]
    named: set[int] = set()
    for f in io["files"]:
        if f["bytes"] < MIN_ISSUER_SHARE * io["bytes"]:
            continue  # not what filled the disk
        out += [_file_culprit(f, **{f"{io['files_by']}_bytes": int(f["bytes"])}, write_paths=sorted(f["write_paths"]))]
        out += _dirtier_culprit(f, named)
    again = io.get("refaulted")
    if again:
        out.append(_file_culprit(again, refaulted_bytes=int(again["refaulted_bytes"])))
        if again["evictor"]:
            out.append(_file_culprit(again["evictor"], added_bytes=again["evictor"]["added_bytes"], evicted=True))
    for i in io["issuers"]:
        if not i["victim"] and not i["flusher"] and i["tid"] not in named and i["bytes"] >= MIN_ISSUER_SHARE * io["bytes"]:
            named.add(i["tid"])
            out.append({"kind": "process" if i["tid"] == i["pid"] else "thread", "name": i["comm"], "tid": i["tid"],
                        "pid": i["pid"], "bytes": int(i["bytes"]), "direction": i["direction"]})
    return out


def _file_culprit(f: dict[str, Any], **amounts: Any) -> dict[str, Any]:
    return {"kind": "file", "name": file_name(f), "device": f["device"], "inode": f["inode"], **amounts}


def _dirtier_culprit(f: dict[str, Any], named: set[int]) -> list[dict[str, Any]]:
    """The file's first dirtier, unless a culprit already names that thread."""
    out = []
    for w in f["dirtiers"][:1]:
        if w["tid"] not in named:
            named.add(w["tid"])
            out.append({"kind": "thread", "name": w["comm"], "tid": w["tid"], "pid": w["pid"],
                        "folios": int(w["folios"]), "function": w["function"]})
    return out


def _preempting(evidence: dict[str, Any]) -> list[dict[str, Any]]:
    """A CPU-contention finding's tasks that took the CPU from its threads (its
    evidence's `preempted_by`), with the preemptions of each."""
    return [{"kind": "process", "name": str(p["comm"]), "pid": p["pid"], "tid": int(p["tid"]),
             "count": int(p["preemptions"])} for p in evidence.get("preempted_by", [])]


def _lock_culprits(evidence: dict[str, Any], pids: dict[int, int]) -> list[dict[str, Any]]:
    """A lock or GIL finding's lock (its busiest address, named where the recorder could)
    and its holders: the threads whose release ended the trainer's waits."""
    if "holders" not in evidence:
        return []
    out = []
    lock = evidence.get("lock") or {}
    for address, name in zip(evidence.get("addresses", [])[:1], evidence.get("address_names", [])[:1]):
        out.append({"kind": "lock", "name": lock.get("name") or name or address, "address": address,
                    **({"lock_kind": lock["kind"]} if lock else {})})
    for h in evidence["holders"]:
        out.append({"kind": "thread", "name": str(h["comm"]), "tid": int(h["tid"]), "pid": pids.get(int(h["tid"])),
                    "seconds": _seconds(h["seconds"]), "holder": True,
                    **({"function": h["function"]} if h.get("function") else {})})
    return out


def _own_seconds(evidence: dict[str, Any], seconds: float) -> float | None:
    """In a job, the seconds the finding's rank itself spent in it (its evidence's), at
    most the starved seconds the finding explains (a rank's timer sleeps in its GPU steps
    are its time, not starved time); None for one process."""
    if "starved_ranks" not in evidence or "starved_s" not in evidence:
        return None
    return min(float(evidence["starved_s"]), float(seconds))


def finding_summary(category: str, share: float, seconds: float, threads: list[dict[str, Any]],
                    evidence: dict[str, Any], *, own_seconds: float | None = None) -> str:
    """A finding in one sentence, from its category's summary template; a finding without
    starved time (numa_remote placement alone) from the `unmeasured` one; one that is
    mostly the trainer loading its own data from the `own_work` one; one whose evidence
    found a `case` of the category's from that case's.  `own_seconds`: in a
    job, the time the finding's rank spent (the sentence says that, not the job's sum)."""
    record = BY_NAME[category]
    seconds = seconds if own_seconds is None else own_seconds
    who = _who(threads)
    case = record.cases.get(evidence.get("case"))
    if case:
        said = case[0].format(who=who, s=seconds, **_case_names(evidence))
        return said + f" ({share:.0%} of starved time)" if seconds else said
    if seconds == 0 and record.unmeasured:
        return record.unmeasured.format(who=who, gpu_node=evidence.get("gpu_node"))
    own = evidence.get("trainer_loading")
    if record.own_work and own and own["seconds"] >= 0.5 * seconds:
        trainer = next((t for t in threads if t["role"] == "trainer"), threads[0] if threads else None)
        workers = own["dataloader_threads"]
        text = record.own_work.format(
            who=_who([trainer] if trainer else []), s=own["seconds"], where=_where(own.get("functions")),
            workers="the DataLoader has no workers" if not workers else
            f"{workers} data-loader thread{'s' if workers > 1 else ''} did not take it off the trainer")
        return text + f" ({share:.0%} of starved time)"
    return record.summary.format(s=seconds, who=who, where=_where(evidence.get("functions"))) + \
        f" ({share:.0%} of starved time)"


def recommendation(category: str, evidence: dict[str, Any]) -> str:
    """What to do: the category's advice for what its evidence found for certain (its
    `case`, formatted with the evidence's `names`), else the category's general advice."""
    record = BY_NAME[category]
    case = record.cases.get(evidence.get("case"))
    return case[1].format(**_case_names(evidence)) if case else record.recommendation


def _case_names(evidence: dict[str, Any]) -> dict[str, Any]:
    """The evidence's `names` for a case's sentences; a `<name>_bytes` number also as
    `<name>`, in units ("1.05 GB"); `again`: what a disk finding's threads read again
    after the page cache dropped it, when that is not the case itself ("" otherwise)."""
    names = dict(evidence.get("names", {}))
    again = (evidence.get("io") or {}).get("refaulted")
    if again and evidence.get("case") != "refault":
        told = refault_names(again, evidence["io"]["devices"][0]["name"])
        names["again"] = (f"; it re-read {size(told['refaulted_bytes'])} of {told['file']} after the page cache "
                          f"dropped it for {told['evictor']}")
    return {"again": "", **names, **{k[:-len("_bytes")]: size(v) for k, v in names.items() if k.endswith("_bytes")}}


def _where(functions: list[dict[str, Any]] | None) -> str:
    """The function most host time went to ("data.py:31 decode_batch"), or why none is named."""
    if not functions:
        return "no on-CPU sample names the function"
    return _function_label(functions[0])


def _function_label(frame: dict[str, Any]) -> str:
    """A Python frame as "data.py:31 decode_batch"; a native one by its symbol alone."""
    return frame_label(frame) if frame.get("file") else str(frame["function"])


def _who(threads: list[dict[str, Any]]) -> str:
    if not threads:
        return "Threads"
    first = threads[0]
    name = f"{first['role']} {first['comm'] or '?'} ({first['tid']})"
    more = len(threads) - 1
    return name + (f" and {more} more thread{'s' if more > 1 else ''}" if more else "")


@dataclass(frozen=True)
class Report:
    """What every renderer takes: an analysis and its JSON document (build_report)."""

    analysis: Analysis
    doc: dict[str, Any]

    @classmethod
    def of(cls, analysis: Analysis) -> "Report":
        return cls(analysis, build_report(analysis))


def render_json(report: Report) -> str:
    return json.dumps(report.doc, indent=2) + "\n"
