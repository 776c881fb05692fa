"""Every ``deploy/examples/*.yaml`` runs as written on the local cluster, to Succeeded.

A server dry run does not show what breaks a real job (an integer ``nvidia.com/gpu: 8`` once
stopped pod creation inside the operator; eight processes per pod started with plain
``python`` hung). So each example is applied as it is, with everything in it (Secrets,
ServiceAccounts, claims), into a namespace that enforces the restricted Pod Security profile,
and runs under the operator until the job Succeeds. Only the training script is replaced: the
``train.py`` argument of the command becomes ``baton_testing/standin_train.py`` (no torch), and
``STANDIN_OUT`` is added to the trainer's env, so that every one of the job's processes leaves
proof of the rank, world size and rendezvous address it was started with.

The cluster of this module is sized like GPU capacity (an AWS p5: 8 GPUs, 192 CPUs, 2 TiB per
node; four spot nodes), so the examples' requests, node selectors and tolerations schedule
unchanged.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from baton_testing.cluster import ClusterConfig, LocalCluster
from baton_testing.operator_harness import (
    NAMESPACE,
    Baton,
    install_operator,
    operator_process,
    unique,
)

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "deploy" / "examples").glob("*.yaml"))
STANDIN = ROOT / "tests" / "baton_testing" / "standin_train.py"
GPU_NODES = ClusterConfig(nodes=4, spot_nodes=4, gpus_per_node=8, cpu="192", memory="2Ti")


@pytest.fixture(scope="module")
def gpu_baton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Baton]:
    """A cluster of GPU-sized spot nodes with the operator running (its own, for sizes)."""
    work = tmp_path_factory.mktemp("examples")
    with LocalCluster.start(work / "cluster", GPU_NODES) as cluster:
        install = install_operator(cluster, work)
        op = operator_process(install, work)
        # As s3-workload-identity.yaml tells the admin to install it.
        op.args += ["--allow-service-account", "trainer"]
        op.start()
        try:
            yield Baton(install=install, workdir=work, operator=op)
        finally:
            op.stop()


def _with_standin(job: dict[str, Any], out: Path) -> dict[str, Any]:
    job = copy.deepcopy(job)
    containers = job["spec"]["template"]["spec"]["containers"]
    trainer = next(c for c in containers if c["name"] == "trainer")
    assert "train.py" in trainer["command"], "the example should run the user's train.py"
    trainer["command"] = [str(STANDIN) if a == "train.py" else a for a in trainer["command"]]
    trainer.setdefault("env", []).append({"name": "STANDIN_OUT", "value": str(out)})
    return job


def _bind_claim(baton: Baton, claim: dict[str, Any]) -> None:
    """Bind a claim to a new volume, as a provisioner would (the local cluster has none)."""
    name = claim["metadata"]["name"]
    pv = unique("pv")
    size = claim["spec"]["resources"]["requests"]["storage"]
    modes = claim["spec"]["accessModes"]
    volume = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": pv},
        "spec": {
            "capacity": {"storage": size},
            "accessModes": modes,
            "persistentVolumeReclaimPolicy": "Delete",
            "hostPath": {"path": str(baton.workdir / pv)},
            "claimRef": {"namespace": NAMESPACE, "name": name},
        },
    }
    k = baton.cluster.kubectl
    k("apply", "-f", "-", input=yaml.safe_dump(volume))
    k("patch", "pv", pv, "--subresource=status", "--type=merge",
      "-p", json.dumps({"status": {"phase": "Bound"}}))  # fmt: skip
    k("patch", "pvc", name, "-n", NAMESPACE, "--type=merge", "-p", json.dumps({
        "metadata": {"annotations": {"pv.kubernetes.io/bind-completed": "yes"}},
        "spec": {"volumeName": pv},
    }))  # fmt: skip
    k("patch", "pvc", name, "-n", NAMESPACE, "--subresource=status", "--type=merge",
      "-p", json.dumps({"status": {"phase": "Bound", "accessModes": modes,
                                   "capacity": {"storage": size}}}))  # fmt: skip


def _delete(baton: Baton, docs: list[dict[str, Any]]) -> None:
    for doc in reversed(docs):
        baton.cluster.kubectl(
            "delete", doc["kind"].lower(), doc["metadata"]["name"], "-n", NAMESPACE,
            "--ignore-not-found", "--wait=false", check=False,
        )  # fmt: skip


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.stem for e in EXAMPLES])
def test_example_runs_as_written(gpu_baton: Baton, example: Path, tmp_path: Path) -> None:
    baton = gpu_baton
    out = tmp_path / "ranks"
    docs = [d for d in yaml.safe_load_all(example.read_text()) if d]
    jobs = [d for d in docs if d["kind"] == "TrainingJob"]
    assert len(jobs) == 1, f"{example.name} should hold one TrainingJob"
    written = jobs[0]
    docs = [_with_standin(d, out) if d is written else d for d in docs]
    name = written["metadata"]["name"]
    try:
        applied = baton.cluster.kubectl(
            "apply", "-n", NAMESPACE, "-f", "-",
            input=yaml.safe_dump_all(docs), check=False,
        )  # fmt: skip
        assert applied.returncode == 0, f"{example.name}: {applied.stderr}"
        for claim in (d for d in docs if d["kind"] == "PersistentVolumeClaim"):
            _bind_claim(baton, claim)
        final = baton.wait_phase(name, "Succeeded", timeout=420)

        spec = written["spec"]
        world = spec["replicas"] * spec.get("procsPerReplica", 1)
        assert final["worldSize"] == world
        assert (final["failures"], final["preemptions"]) == (0, 0)
        seen = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out.glob("*.json")}
        assert sorted(seen) == list(range(world)), f"ranks that ran: {sorted(seen)}"
        assert {s["WORLD_SIZE"] for s in seen.values()} == {str(world)}
        assert {s["LOCAL_WORLD_SIZE"] for s in seen.values()} == {
            str(spec.get("procsPerReplica", 1))
        }
        assert len({s["MASTER_ADDR"] for s in seen.values()}) == 1, "one rendezvous address"
        assert {s["BATON_CHECKPOINT_URI"] for s in seen.values()} == {spec["checkpoint"]["uri"]}

        # The pods carry the template's resources as the user wrote them.
        wanted = next(
            c for c in written["spec"]["template"]["spec"]["containers"] if c["name"] == "trainer"
        ).get("resources", {})
        for pod in baton.pods(name):
            trainer = next(c for c in pod["spec"]["containers"] if c["name"] == "trainer")
            for kind, values in wanted.items():
                for resource, quantity in values.items():
                    assert trainer["resources"][kind][resource] == str(quantity), (
                        f"{pod['metadata']['name']}: {kind}.{resource}"
                    )
    finally:
        _delete(baton, docs)
