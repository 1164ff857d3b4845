"""deploy/prometheus and deploy/grafana against what `trainbpf health` writes: the rules
pass `promtool check rules`, and `promtool test rules` fed with the textfiles of three
nodes' checks fires what it should and nothing else; every metric and label the rules
and the dashboard name is one health writes; the starved-share levels are health's."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from bench_modules import bench_module
from kernel_env import which_or_fail
from synth import healthy, input_pipeline
from test_health_outputs import parse_exposition

from trainbpf.health.config import DEFAULT_THRESHOLDS, HealthConfig
from trainbpf.health.outputs import METRICS, render_textfile
from trainbpf.health.results import failed_result
from trainbpf.health.run import assess
from trainbpf.health.targets import Target
from trainbpf.trace.reader import read_trace

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
RULES = DEPLOY / "prometheus" / "trainbpf-rules.yml"
DASHBOARD = DEPLOY / "grafana" / "trainbpf-health.json"
TIMESTAMP = "trainbpf_health_last_run_timestamp_seconds"
MINUTES = 60  # samples of each input series, one a minute

gen_job = bench_module("gen_job")


def promtool() -> str:
    return which_or_fail("promtool", "prometheus")


def _job_targets(trace: Path) -> tuple[list[Target], dict]:
    """The ranks of the launcher in `trace` as device holders, each with its tree."""
    procs = read_trace(trace).frame("thread").query("tid == pid")
    launcher = int(procs[procs.comm == "torchrun"].pid.iloc[0])
    ranks = [int(p) for p in procs[procs.peer_tid == launcher].pid]
    trees = {r: ({r, *map(int, procs[procs.peer_tid == r].pid)}, {r}) for r in ranks}
    return [Target(r, "python3", "python3 train.py", "device") for r in ranks], trees


@pytest.fixture(scope="module")
def textfiles(tmp_path_factory) -> dict[str, str]:
    """node -> the textfile its check wrote, each graded from a trace as `trainbpf health`
    grades its recording (assess, then the textfile writer): a job of two ranks whose
    rank 1 holds the other back (warning), a process starved by its input pipeline
    (critical), and a healthy one."""
    folder = tmp_path_factory.mktemp("health")
    [job] = gen_job.write_job(folder / "job", traces=1, ranks_per_trace=2, seconds=3.0, slow_rank=1)
    single = Target(100, "python", "python train.py", "device")
    checks = {
        "node-job": (job, *_job_targets(job)),
        "node-starved": (input_pipeline(4.0).write(folder / "starved.parquet"), [single], {100: ({100, 200}, {100, 200})}),
        "node-ok": (healthy(4.0).write(folder / "ok.parquet"), [single], {100: ({100, 200}, {100, 200})}),
    }
    texts = {node: render_textfile(assess(trace_path=path, targets=targets, trees=trees, config=HealthConfig(),
                                          started=time.time() - 6, host=node))
             for node, (path, targets, trees) in checks.items()}
    # A check that could not run (another run held the lock, say) writes this.
    texts["node-unknown"] = render_textfile(failed_result(config=HealthConfig(), started=time.time() - 1,
                                                          host="node-unknown", error="another run holds the lock"))
    return texts


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return parse_exposition(text)


def input_series(text: str, instance: str, *, reporting: bool = True, gone_after: int | None = None) -> list[dict]:
    """A textfile's samples as promtool input series of node `instance`: each value held
    for the hour, as node_exporter serves it between checks.  The run timestamp is
    rewritten onto promtool's clock (it starts at 0): a check every 15 minutes, or
    (`reporting` false) only the first.  `gone_after`: the textfile vanishes then."""
    out = []
    for (name, labels), value in sorted(samples(text).items()):
        selector = ",".join(f"{k}={json.dumps(v)}" for k, v in [*labels, ("instance", instance), ("job", "node")])
        if name == TIMESTAMP:
            values = " ".join(f"{m * 60}x14" for m in range(0, MINUTES, 15)) if reporting else f"0x{MINUTES - 1}"
        else:
            values = f"{value!r}x{MINUTES - 1}"
        if gone_after is not None:
            values = f"{value!r}x{gone_after - 1} _x{MINUTES - gone_after}"
        out.append({"series": f"{name}{{{selector}}}", "values": values})
    return out


def percent(value: float) -> str:
    """Prometheus's humanizePercentage."""
    return f"{value * 100:.4g}%"


def starved_alert(instance: str, pid: str, ratio: float, severity: str) -> dict:
    summary = f"{instance} pid {pid}: GPU starved {percent(ratio)} of the time"
    annotations = {"summary": summary}
    if severity == "critical":
        annotations["description"] = (
            "The trainer stalled while its GPU idled for at least 40% of two checks in a row. "
            f'trainbpf_finding_share_ratio{{instance="{instance}",pid="{pid}"}} names the cause.')
    return {"exp_labels": {"instance": instance, "job": "node", "pid": pid, "severity": severity},
            "exp_annotations": annotations}


def node_alert(instance: str, summary: str, severity: str = "warning") -> dict:
    return {"exp_labels": {"instance": instance, "job": "node", "severity": severity},
            "exp_annotations": {"summary": summary}}


def rule_tests(textfiles: dict[str, str]) -> dict:
    job, starved = samples(textfiles["node-job"]), samples(textfiles["node-starved"])
    job_ratios = {dict(labels)["pid"]: v for (name, labels), v in job.items() if name == "trainbpf_target_starved_ratio"}
    starved_ratio = starved[("trainbpf_target_starved_ratio", (("pid", "100"),))]
    top_seconds = starved[("trainbpf_finding_seconds", (("category", "input_pipeline"), ("pid", "100")))]
    rank_1 = next((dict(labels), v) for (name, labels), v in job.items()
                  if name == "trainbpf_rank_starved_seconds" and ("rank", "1") in labels)
    series = (input_series(textfiles["node-job"], "node-job") + input_series(textfiles["node-starved"], "node-starved")
              + input_series(textfiles["node-ok"], "node-ok", reporting=False)
              + input_series(textfiles["node-ok"], "node-gone", gone_after=20)
              + input_series(textfiles["node-unknown"], "node-unknown"))

    def alerts(at: str, name: str, *expected: dict) -> dict:
        return {"eval_time": at, "alertname": name, "exp_alerts": list(expected)}

    return {"rule_files": [str(RULES)], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": series,
        "alert_rule_test": [
            alerts("10m", "TrainbpfGpuStarvedCritical"),  # one check so far: not yet
            alerts("30m", "TrainbpfGpuStarvedCritical", starved_alert("node-starved", "100", starved_ratio, "critical")),
            alerts("30m", "TrainbpfGpuStarvedWarning",
                   *[starved_alert("node-job", pid, ratio, "warning") for pid, ratio in sorted(job_ratios.items())]),
            alerts("20m", "TrainbpfStragglerPersists"),
            alerts("35m", "TrainbpfStragglerPersists",
                   node_alert("node-job", "node-job: rank 1 is the job's straggler for 30 minutes")),
            alerts("30m", "TrainbpfHealthStale"),
            alerts("55m", "TrainbpfHealthStale", node_alert("node-ok", "node-ok: no trainbpf health check for 55m 0s")),
            alerts("55m", "TrainbpfHealthGone", node_alert("node-gone", "node-gone: trainbpf health series have disappeared")),
            alerts("20m", "TrainbpfHealthCannotCheck"),
            alerts("55m", "TrainbpfHealthCannotCheck", node_alert(
                "node-unknown", "node-unknown: trainbpf health could not check the node (status 3); see its JSON's error")),
            alerts("55m", "TrainbpfProbeLosses"),
        ],
        "promql_expr_test": [{
            "expr": 'instance_category:trainbpf_finding_seconds:top{instance="node-starved"}', "eval_time": "30m",
            "exp_samples": [{"labels": 'instance_category:trainbpf_finding_seconds:top{category="input_pipeline",instance="node-starved"}',
                             "value": top_seconds}],
        }, {
            "expr": 'instance_rank:trainbpf_rank_starved_ratio{instance="node-job",rank="1"}', "eval_time": "30m",
            "exp_samples": [{"labels": 'instance_rank:trainbpf_rank_starved_ratio{instance="node-job",job="node",'
                                       f'pid="{rank_1[0]["pid"]}",rank="1"}}',
                             "value": rank_1[1] / job[("trainbpf_health_recorded_seconds", ())]}],
        }],
    }]}


def test_promtool_checks_the_rules():
    run = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout


def test_rules_fire_on_what_health_wrote(textfiles, tmp_path):
    """A critical process, two warning ranks, the straggler that stays, a check that could
    not run, a node whose checks stopped and one whose series vanished fire, each once
    its `for` has passed; the healthy node does not, nor the alerts no node meets."""
    assert samples(textfiles["node-job"])[("trainbpf_straggler_rank", ())] == 1
    assert samples(textfiles["node-starved"])[("trainbpf_health_status", ())] == 2
    assert samples(textfiles["node-ok"])[("trainbpf_health_status", ())] == 0
    assert samples(textfiles["node-unknown"])[("trainbpf_health_status", ())] == 3
    tests = tmp_path / "trainbpf-rules.test.yml"
    tests.write_text(yaml.safe_dump(rule_tests(textfiles), sort_keys=False))
    run = subprocess.run([promtool(), "test", "rules", str(tests)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


def rule_expressions() -> list[str]:
    return [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def recorded_names() -> set[str]:
    return {r["record"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "record" in r}


def panel_expressions() -> list[str]:
    return [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]


def dashboard_expressions() -> list[str]:
    """The panels' queries and the variables' (label_values(...), Grafana's, not PromQL)."""
    variables = json.loads(DASHBOARD.read_text())["templating"]["list"]
    return panel_expressions() + [v["definition"] for v in variables if v["type"] == "query"]


# PromQL, loosely: a metric-like name, label matchers, and the label lists of by/on/...
NAME = re.compile(r"(?<![\w:$])([A-Za-z_:][\w:]*)(?![\w:])")
MATCHER = re.compile(r'(\w+)\s*(?:=~|!~|!=|=)\s*"([^"]*)"')
LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset", "bool"}


def test_rules_and_dashboard_name_only_what_health_writes(textfiles):
    written = {name for text in textfiles.values() for name, _ in samples(text)}
    labels = {k for text in textfiles.values() for _, pairs in samples(text) for k, _ in pairs} | {"instance", "job"}
    records = recorded_names()
    exprs = rule_expressions() + dashboard_expressions()
    for expr in exprs:
        names = set(NAME.findall(re.sub(r'"[^"]*"', '""', expr))) - KEYWORDS
        assert {n for n in names if n.startswith("trainbpf_")} <= set(METRICS), expr
        assert {n for n in names if ":" in n} <= records, expr
        used = {k for k, _ in MATCHER.findall(expr)}
        used |= {k.strip() for group in LABEL_LIST.findall(expr) for k in group.split(",") if k.strip()}
        assert used <= labels, f"{expr}: labels {used - labels} are not written by health"
        assert all(v in DEFAULT_THRESHOLDS for k, v in MATCHER.findall(expr) if k == "check"), expr
    named = {n for e in exprs for n in NAME.findall(e) if n.startswith("trainbpf_")}
    # The rules and the dashboard read series these checks wrote: each named series is one
    # of them (the step metrics need a traced CUDA library, not shown here).
    assert named <= written, named - written


def test_the_starved_alerts_use_healths_levels():
    rules = {r["alert"]: r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r}
    level = DEFAULT_THRESHOLDS["starved_ratio"]
    assert rules["TrainbpfGpuStarvedCritical"] == f"trainbpf_target_starved_ratio >= {level.critical}"
    assert rules["TrainbpfGpuStarvedWarning"] == \
        f"trainbpf_target_starved_ratio >= {level.warning} and trainbpf_target_starved_ratio < {level.critical}"


def test_dashboard_queries_parse_and_cover_the_panels(tmp_path):
    """Each query, its variables given values, is a valid PromQL expression (promtool
    checks it as a recording rule); the panels the fleet asks for are there."""
    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] and len({p["id"] for p in board["panels"]}) == len(board["panels"])
    assert all(p["datasource"]["uid"] == "${datasource}" for p in board["panels"])
    titles = [p["title"] for p in board["panels"]]
    for wanted in ("Starved share per node", "Starved share per training process", "Starved share per rank of a job",
                   "Top cause per node over time", "Straggler rank per node", "Probe losses", "Health check cost"):
        assert wanted in titles
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": e.replace("$instance", ".*")} for i, e in enumerate(panel_expressions())]}]}
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump(rules))
    run = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
