"""What the report says of a job of several ranks (analyzers/job/rank_analysis.py): the JSON `ranks`
and `straggler` sections, each finding's rank culprits, and the text report's per-rank
table and straggler line."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from trainbpf.analyzers.intervals import NS_PER_S
from trainbpf.reports.present import SHORT_ID_CHARS

if TYPE_CHECKING:
    from trainbpf.analyzers.job.join import JobResult


def _round(value: float) -> float | None:
    return round(float(value), 6) if math.isfinite(float(value)) else None


def ranks_section(job: JobResult | None) -> list[dict[str, Any]] | None:
    """The JSON `ranks`: None for one process, else one object per rank."""
    if job is None:
        return None
    out = []
    for r in job.ranks.itertuples(index=False):
        out.append({
            "rank": int(r.rank), "local_rank": None if r.local_rank < 0 else int(r.local_rank),
            "world_size": None if r.world_size < 0 else int(r.world_size), "pid": int(r.pid),
            "trainer_tid": int(r.trainer_tid), "node": str(r.node), "source": str(r.source),
            "starved_s": _round(r.starved_ns / NS_PER_S), "collective_wait_s": _round(r.collective_wait_ns / NS_PER_S),
            "collectives": int(r.collectives), "step_p50_ms": _round(r.step_p50_ns / 1e6),
            "last_arrival_share": _round(r.last_share), "top_category": str(r.top_category) or None,
            "container": str(r.container) or None,
        })
    return out


def straggler_section(job: JobResult | None) -> dict[str, Any] | None:
    """The JSON `straggler`: the rank the others waited for, or None."""
    if job is None or job.straggler is None:
        return None
    s = job.straggler
    return {"rank": s["rank"], "pid": s["pid"], "last_arrival_share": _round(s["last_arrival_share"]),
            "others_waited_s": _round(s["others_waited_s"]), "category": s["category"]}


def rank_culprits(evidence: dict[str, Any]) -> list[dict[str, Any]]:
    """A job finding's ranks where its time was spent, as culprits of kind "rank"."""
    return [{"kind": "rank", "name": f"rank {c['rank']}", "rank": int(c["rank"]), "pid": int(c["pid"]),
             "seconds": _round(c["seconds"])} for c in evidence.get("culprit_ranks", [])]


RANK_HEAD = ("rank", "pid", "node", "steps", "step p50", "starved", "collective wait", "arrived last", "top cause",
             "container")
# The columns of RANK_HEAD that are text (left-aligned), the others numbers.
RANK_TEXT_COLUMNS = (2, 8, 9)


def rank_head(ranks: list[dict[str, Any]]) -> tuple[str, ...]:
    """RANK_HEAD; its `container` column only where the ranks ran in different containers."""
    return RANK_HEAD if len({r["container"] for r in ranks}) > 1 else RANK_HEAD[:-1]


def rank_cells(ranks: list[dict[str, Any]]) -> list[list[str]]:
    """The per-rank table's cells (columns rank_head) of the JSON `ranks`."""
    shown = len(rank_head(ranks))
    return [[str(r["rank"]), str(r["pid"]), r["node"] or "?", str(r["collectives"]),
             "-" if r["step_p50_ms"] is None else f"{r['step_p50_ms']:.1f} ms", f"{r['starved_s']:.2f} s",
             f"{r['collective_wait_s']:.2f} s", f"{100 * (r['last_arrival_share'] or 0):.0f}%", r["top_category"] or "-",
             (r["container"] or "-")[:SHORT_ID_CHARS]][:shown]
            for r in ranks]


def ranks_known_by(ranks: list[dict[str, Any]]) -> str:
    """How the ranks were found, in words."""
    return "their environments" if all(r["source"] == "environment" for r in ranks) else \
        "their collective backend's threads (no rank variables recorded: numbered in pid order)"


def straggler_sentence(straggler: dict[str, Any] | None) -> str:
    """The straggler line's text after "Straggler: "."""
    if not straggler:
        return "none (no rank arrived last in most collectives while the others waited long for it)"
    s = straggler
    cause = f"; what it was doing meanwhile: {s['category']}" if s["category"] else ""
    return (f"rank {s['rank']} (pid {s['pid']}) arrived last in {100 * s['last_arrival_share']:.0f}% "
            f"of collectives; the other ranks waited {s['others_waited_s']:.2f} s for it{cause}")


def rank_lines(report: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    """The text report's per-rank table and straggler line; for one rank of a job traced
    alone (metadata `job`), that the others are not traced."""
    ranks = report.get("ranks")
    lone = meta.get("job") or {}
    if not ranks and (lone.get("world_size") or 0) > 1 and lone.get("target_rank") is not None:
        return [f"  Rank {lone['target_rank']} of {lone['world_size']}: the other ranks are not traced, so the "
                "report cannot say which rank its collectives waited for (record the launcher's pid to trace "
                "every rank)"]
    if not ranks:
        return []
    rows, head = rank_cells(ranks), rank_head(ranks)
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    fmt = lambda row: "  ".join(c.ljust(w) if i in RANK_TEXT_COLUMNS else c.rjust(w)  # noqa: E731
                                for i, (c, w) in enumerate(zip(row, widths)))
    lines = [f"  Ranks: {len(ranks)}, known by {ranks_known_by(ranks)}; steps are counted at collectives:",
             "    " + fmt(head)]
    lines += ["    " + fmt(row) for row in rows]
    lines.append("  Straggler: " + straggler_sentence(report.get("straggler")))
    return lines


def job_summary(evidence: dict[str, Any], share: float, seconds: float, summary: str) -> str:
    """A job finding's sentence: on which rank, and whose starved time it explains."""
    if "starved_ranks" not in evidence:
        return summary
    sentence = summary.rsplit(" (", 1)[0]
    victims = [r["rank"] for r in evidence["starved_ranks"]]
    held_ranks = evidence.get("held_ranks") or []
    whose = f"ranks {', '.join(str(r) for r in sorted(victims))}" if len(victims) > 1 else f"rank {victims[0]}"
    held = (f"; rank{'s' if len(held_ranks) > 1 else ''} {', '.join(str(r) for r in held_ranks)} waited for it "
            "in their collectives") if held_ranks else ""
    return (f"On rank {evidence['rank']}: {sentence}{held}. It explains {seconds:.2f} s of starved time of "
            f"{whose} ({share:.0%} of the job's)")
