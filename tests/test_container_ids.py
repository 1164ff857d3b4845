"""A container's identity from a cgroup path (tracer/samplers/containers.py), with the
path shapes runtimes and kubelet make, and its way into the analysis (the container
rows read back per process)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from trainbpf.analyzers.threads.containers import container_of, process_containers
from trainbpf.tracer.samplers.containers import ContainerIdentity, from_cgroup_file, identify

CID = "4c1d0a3bb2e0f1bd7d9e2a6c55f0e3a8c2b1d4e5f60718293a4b5c6d7e8f9a0b"
UID = "8f4c2b1e-3d5a-4e6f-9a7b-0c1d2e3f4a5b"
POD = UID.replace("-", "_")

PATHS = [
    # docker, systemd cgroup driver (v2 and v1 alike)
    (f"/system.slice/docker-{CID}.scope", (CID, "docker", None)),
    # docker, cgroupfs driver
    (f"/docker/{CID}", (CID, "docker", None)),
    # Kubernetes with containerd, systemd driver: burstable, best-effort, guaranteed pods
    (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD}.slice/cri-containerd-{CID}.scope",
     (CID, "containerd", UID)),
    (f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD}.slice/cri-containerd-{CID}.scope",
     (CID, "containerd", UID)),
    (f"/kubepods.slice/kubepods-pod{POD}.slice/cri-containerd-{CID}.scope", (CID, "containerd", UID)),
    # Kubernetes with cri-o
    (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD}.slice/crio-{CID}.scope",
     (CID, "cri-o", UID)),
    # Kubernetes, cgroupfs driver (v1 hierarchies): the bare id says no runtime
    (f"/kubepods/burstable/pod{UID}/{CID}", (CID, None, UID)),
    (f"/kubepods/besteffort/pod{UID}/{CID}", (CID, None, UID)),
    (f"/kubepods/pod{UID}/{CID}", (CID, None, UID)),
    # Kubernetes on docker (dockershim), systemd driver
    (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD}.slice/docker-{CID}.scope",
     (CID, "docker", UID)),
    # podman: rootful, rootless, cgroupfs
    (f"/machine.slice/libpod-{CID}.scope", (CID, "podman", None)),
    (f"/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{CID}.scope", (CID, "podman", None)),
    (f"/libpod_parent/libpod-{CID}", (CID, "podman", None)),
    # systemd inside the container: its own units below the container's cgroup
    (f"/system.slice/docker-{CID}.scope/init.scope", (CID, "docker", None)),
    # docker in docker: the inner container
    (f"/docker/{'a' * 64}/docker/{CID}", (CID, "docker", None)),
]

NOT_CONTAINERS = [
    "/", "/init.scope", "/user.slice/user-0.slice/session-3.scope", "/system.slice/sshd.service",
    f"/machine.slice/libpod-conmon-{CID}.scope",  # podman's monitor, not the container
    f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD}.slice/crio-conmon-{CID}.scope",
    f"/system.slice/{CID}",  # a bare id outside docker's and a pod's folders
    f"/system.slice/docker-{CID[:12]}.scope",  # not a whole id
    f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD}.slice",  # the pod, no container
]


@pytest.mark.parametrize("path,expected", PATHS)
def test_identify_path_shapes(path, expected):
    found = identify(path)
    assert found is not None, path
    assert (found.id, found.runtime, found.pod_uid, found.cgroup) == (*expected, path)


@pytest.mark.parametrize("path", NOT_CONTAINERS)
def test_no_container(path):
    assert identify(path) is None


def test_cgroup_file_v1_lines():
    """A v1 machine: one line per hierarchy; the systemd one names the session, the
    others the container."""
    text = (f"12:pids:/docker/{CID}\n11:memory:/docker/{CID}\n4:cpu,cpuacct:/docker/{CID}\n"
            "1:name=systemd:/user.slice/user-0.slice/session-1.scope\n")
    found = from_cgroup_file(text)
    assert (found.id, found.runtime, found.cgroup) == (CID, "docker", f"/docker/{CID}")


def test_cgroup_file_v2_first():
    """The v2 line wins over a v1 hierarchy's (hybrid mode)."""
    v2 = f"/kubepods.slice/kubepods-pod{POD}.slice/cri-containerd-{CID}.scope"
    found = from_cgroup_file(f"1:name=systemd:/docker/{'b' * 64}\n0::{v2}\n")
    assert (found.id, found.runtime, found.pod_uid) == (CID, "containerd", UID)


def test_cgroup_file_none():
    assert from_cgroup_file("0::/user.slice/user-0.slice/session-1.scope\n") is None
    assert from_cgroup_file("") is None


def test_fields_escape_the_path():
    """The cgroup path is any bytes a cgroup's creator chose: stored printable."""
    found = ContainerIdentity(CID, None, None, f"/evil\x1b[2J/docker/{CID}")
    assert found.fields() == {"id": CID, "cgroup": f"/evil\\x1b[2J/docker/{CID}"}


def test_process_containers_newest_read():
    """Rows as a trace holds them: one field per row; a process read twice keeps its
    newest read; a field not shown is ""."""
    rows = pd.DataFrame({"ts_ns": [1, 1, 1, 5, 5, 9, 9, 9], "pid": [10, 10, 10, 10, 10, 20, 20, 20],
                         "field": ["id", "runtime", "cgroup", "id", "cgroup", "id", "pod_uid", "cgroup"],
                         "value": ["old", "docker", "/docker/old", CID, f"/kubepods/pod{UID}/{CID}",
                                   "c" * 64, UID, "/x"]})
    table = process_containers(rows)
    assert table["pid"].tolist() == [10, 20]
    assert container_of(table, 10) == {"id": CID, "runtime": None, "pod_uid": None,
                                       "cgroup": f"/kubepods/pod{UID}/{CID}"}
    assert container_of(table, 20)["pod_uid"] == UID
    assert container_of(table, 30) is None
    empty = process_containers(rows.iloc[:0])
    assert list(empty.columns) == ["pid", "id", "runtime", "pod_uid", "cgroup"] and container_of(empty, 10) is None


def test_reports_show_the_container(tmp_path):
    """The traced process's container in the JSON (`container`), the text header and the
    HTML header; a trace without container rows says none."""
    from synth import TRAINER, input_pipeline, t
    from trainbpf.reports.render import run_analyze

    cgroup = f"/kubepods.slice/kubepods-pod{POD}.slice/cri-containerd-{CID}.scope"
    synth = input_pipeline()
    for field, value in {"id": CID, "runtime": "containerd", "pod_uid": UID, "cgroup": cgroup}.items():
        synth.add("container", ts_ns=t(0), pid=TRAINER, name=field, state=value)
    path = synth.write(tmp_path / "t.parquet")
    doc = json.loads(run_analyze(path=path, fmt="json"))
    assert doc["container"] == {"id": CID, "runtime": "containerd", "pod_uid": UID, "cgroup": cgroup}
    words = f"{CID[:12]} (containerd), pod {UID}"
    assert f"  container: {words}; cgroup {cgroup}\n" in run_analyze(path=path, fmt="text")
    assert f"<b>Container:</b> {words} · cgroup <code>{cgroup}</code>" in run_analyze(path=path, fmt="html")
    plain = input_pipeline().write(tmp_path / "plain.parquet")
    assert json.loads(run_analyze(path=plain, fmt="json"))["container"] is None
    assert "container:" not in run_analyze(path=plain, fmt="text")


def _rank(rank: int, container: str | None) -> dict:
    return {"rank": rank, "pid": 10 + rank, "node": "n", "collectives": 5, "step_p50_ms": 40.0, "starved_s": 1.0,
            "collective_wait_s": 0.5, "last_arrival_share": 0.2, "top_category": "input_pipeline",
            "container": container}


def test_rank_table_names_containers_only_where_ranks_differ():
    from trainbpf.reports.job import RANK_HEAD, rank_cells, rank_head

    apart = [_rank(0, CID), _rank(1, "d" * 64)]
    assert rank_head(apart) == RANK_HEAD and rank_head(apart)[-1] == "container"
    assert [row[-1] for row in rank_cells(apart)] == [CID[:12], "d" * 12]
    together = [_rank(0, CID), _rank(1, CID)]
    assert "container" not in rank_head(together)
    assert all(len(row) == len(rank_head(together)) for row in rank_cells(together))
    assert "container" not in rank_head([_rank(0, None), _rank(1, None)])
