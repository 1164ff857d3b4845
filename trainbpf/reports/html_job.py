"""The HTML report's parts for a job of several ranks (analyzers/job/rank_analysis.py): a timeline lane
per rank, labelled "rank R (pid P)", with its trainer's states and a strip of its starved
time by cause; and the text report's per-rank table and straggler line (reports/job.py).
One process keeps its single "trainer state" lane."""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pandas as pd

from trainbpf.reports.job import (
    rank_head,
    RANK_TEXT_COLUMNS,
    rank_cells,
    ranks_known_by,
    straggler_sentence,
)

if TYPE_CHECKING:
    from trainbpf.analyzers.pipeline import Analysis


@dataclass(frozen=True)
class Lane:
    """One trainer's row of the timeline: its state mix per column and, for a rank of a
    job, a strip of its own starved time by cause under it."""

    label: str
    tid: int | None
    rank: int | None = None  # None: the one trainer of a single process
    pid: int | None = None
    starved: pd.DataFrame | None = None  # the rank's starved pieces (findings.ATTRIBUTED_COLUMNS)


def trainer_lanes(analysis: Analysis) -> list[Lane]:
    """A lane per rank of a job, in rank order; the trainer's one lane for one process."""
    job = analysis.job
    if job is None:
        return [Lane("trainer state", analysis.trainer_tid)]
    starved = analysis.starved
    return [Lane(f"rank {r.rank} (pid {r.pid})", int(r.trainer_tid), int(r.rank), int(r.pid),
                 starved[starved["rank"].to_numpy() == r.rank])
            for r in job.ranks.itertuples(index=False)]


def rank_section(report: dict[str, Any]) -> list[str]:
    """The heading, per-rank table and straggler line of a job; nothing for one process."""
    ranks = report.get("ranks")
    if not ranks:
        return []

    def cell(tag: str, i: int, text: str) -> str:
        numeric = "" if i in RANK_TEXT_COLUMNS else ' class="n"'
        return f"<{tag}{numeric}>{html.escape(text)}</{tag}>"

    head = "".join(cell("th", i, h) for i, h in enumerate(rank_head(ranks)))
    rows = "".join(f'<tr data-rank="{r["rank"]}">' + "".join(cell("td", i, c) for i, c in enumerate(cells)) + "</tr>"
                   for r, cells in zip(ranks, rank_cells(ranks)))
    return ["<h2>Ranks</h2>",
            f'<p class="meta">{len(ranks)} ranks, known by {html.escape(ranks_known_by(ranks))}; steps are counted '
            "at collectives</p>",
            f'<table class="num ranks"><tr>{head}</tr>{rows}</table>',
            f'<p class="meta straggler"><b>Straggler:</b> {html.escape(straggler_sentence(report.get("straggler")))}</p>']
