#!/usr/bin/env python3
"""The scenario suite recorded by this revision's recorder and by another's, analysed by
this revision: do the answers stay the same (issue 13, target 4)?

For each scenario (tests/scenario_harness.py: one injected bottleneck with a known
answer), `--runs` recordings by each recorder, alternating, each analysed the same way
(with `--together`, both recorders record the same run of the workload at once, and
each trace is analysed over the same seconds of load: what each recorder captures,
apart from how its own cost moves the workload);
it prints every finding's share per run, the top category of each run, and per category
the difference between the median shares of the two recorders.  The answer counts as
kept when every run of both names the expected top category and the medians of every
category differ by at most `--tolerance` (0.05).  The healthy run's answer is "no
critical finding": it is kept when no run of either recorder has one; the shares of its
few short stalls are printed but not judged (its runs by one recorder differ by 0.1-0.3).
Runs of the same recorder differ too: the spread column gives that noise beside the
difference.

    sudo .venv/bin/python scripts/compare_scenarios.py --baseline REV [--runs 2] [--together] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
import benchlib as bl  # noqa: E402
import scenario_harness as sh  # noqa: E402


def shares(result: sh.ScenarioResult) -> dict[str, float]:
    out: dict[str, float] = {}
    for f in result.findings:
        out[f["category"]] = out.get(f["category"], 0.0) + float(f["share"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, metavar="REV", help="the git revision whose recorder is compared")
    ap.add_argument("--runs", type=int, default=2, help="recordings per scenario and recorder")
    ap.add_argument("--only", nargs="*", default=[], metavar="NAME", help="scenario names (default: all)")
    ap.add_argument("--tolerance", type=float, default=0.05, help="largest difference of median shares")
    ap.add_argument("--gpu-source", default="nvidia-smi", choices=sh.GPU_SOURCES)
    ap.add_argument("--together", action="store_true",
                    help="both recorders on the same run of the workload, at once")
    args = ap.parse_args()

    scenarios = [s for s in sh.SCENARIOS if (not args.only or s.name in args.only)
                 and (s.requires is None or importlib.util.find_spec(s.requires) is not None)]
    tmp = Path(tempfile.mkdtemp(prefix="trainbpf-compare-"))
    baseline = bl.revision_package(args.baseline, tmp / "baseline")
    recorders = {"this revision": None, f"at {args.baseline}": baseline}
    kept_all = True
    print(f"{len(scenarios)} scenarios, {args.runs} runs per recorder"
          f"{', both recorders on the same run' if args.together else ''}; recordings analysed by this revision")
    for scenario in scenarios:
        results: dict[str, list[dict[str, float]]] = {name: [] for name in recorders}
        tops: dict[str, list[str]] = {name: [] for name in recorders}
        critical: dict[str, list[bool]] = {name: [] for name in recorders}
        for run in range(args.runs):
            order = dict(recorders.items() if run % 2 == 0 else reversed(list(recorders.items())))
            batches = ([order] if args.together else [{name: path} for name, path in order.items()])
            for chosen in batches:
                work = tmp / f"{scenario.id}-{run}-{'both' if len(chosen) > 1 else 'base' if any(chosen.values()) else 'this'}"
                work.mkdir()
                try:
                    got = sh.run_scenario_recorders(scenario, work, args.gpu_source, chosen)
                except sh.ScenarioError as exc:
                    print(f"  {scenario.id} {', '.join(chosen)}: {exc}".splitlines()[0], flush=True)
                    continue
                for name, res in got.items():
                    results[name].append(shares(res))
                    tops[name].append(res.top["category"] if res.top else "none")
                    critical[name].append(any(f["severity"] == "critical" for f in res.findings))
        expected = set(scenario.expected)  # empty for the healthy run
        categories = sorted({c for runs in results.values() for r in runs for c in r})
        rows, worst = [], 0.0
        for c in categories:
            meds = {}
            for name, runs in results.items():
                values = [r.get(c, 0.0) for r in runs]
                meds[name] = (statistics.median(values) if values else float("nan"), values)
            (this_med, this_vals), (base_med, base_vals) = meds.values()
            diff = abs(this_med - base_med)
            worst = max(worst, diff)
            rows.append([c, " ".join(f"{v:.2f}" for v in this_vals), " ".join(f"{v:.2f}" for v in base_vals),
                         f"{diff:.3f}", f"{max(this_vals + base_vals) - min(this_vals + base_vals):.3f}"])
        if scenario.healthy:  # the answer: no critical finding in any run
            found = any(c for runs in critical.values() for c in runs)
            kept = all(results.values()) and not found
            verdict = (f"{'a critical finding in some run' if found else 'no critical finding in any run'}; "
                       f"largest median difference {worst:.3f} (not judged)")
        else:
            right = all(t in expected for ts in tops.values() for t in ts)
            kept = right and worst <= args.tolerance and all(results.values())
            verdict = f"largest median difference {worst:.3f} (tolerance {args.tolerance})"
        kept_all &= kept
        bl.print_table(f"{scenario.id}: expected {', '.join(sorted(expected)) or 'no critical finding'}; tops: "
                       + "; ".join(f"{name} {', '.join(ts)}" for name, ts in tops.items()),
                       ["category", "shares, this revision", f"shares, at {args.baseline}", "median diff", "spread"],
                       rows)
        print(f"  {'kept' if kept else 'CHANGED'}: {verdict}", flush=True)
    print(f"\nsummary: {'every answer kept' if kept_all else 'some answers changed'} "
          f"({len(scenarios)} scenarios, {args.runs} runs each per recorder)")
    sys.exit(0 if kept_all else 1)


if __name__ == "__main__":
    main()
