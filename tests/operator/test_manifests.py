"""The pure builders: env contract, native sidecar, restricted security, affinity, owners."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest
from baton_operator.pure import manifests
from baton_operator.pure.model import JobSpec
from baton_operator.pure.settings import OperatorConfig

CONFIG = OperatorConfig(sidecar_image="baton:test", sidecar_command=("baton-sidecar", "-v"))


def spec(**overrides: Any) -> JobSpec:
    body: dict[str, Any] = {
        "metadata": {"name": "tiny", "namespace": "ml", "uid": "u-1", "generation": 1},
        "spec": {
            "replicas": 2,
            "procsPerReplica": 1,
            "template": {
                "metadata": {"labels": {"team": "a"}, "annotations": {"note": "x"}},
                "spec": {
                    "containers": [
                        {
                            "name": "trainer",
                            "image": "train:1",
                            "command": ["python", "train.py"],
                            "env": [{"name": "RANK", "value": "99"}, {"name": "LR", "value": "1"}],
                            "securityContext": {"privileged": False, "runAsUser": 1000},
                        },
                        {"name": "logger", "image": "log:1"},
                    ],
                    "tolerations": [{"key": "gpu", "operator": "Exists"}],
                    "affinity": {
                        "nodeAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": {
                                "nodeSelectorTerms": [
                                    {
                                        "matchExpressions": [
                                            {"key": "pool", "operator": "In", "values": ["spot"]}
                                        ]
                                    },
                                    {
                                        "matchExpressions": [
                                            {"key": "pool", "operator": "In", "values": ["od"]}
                                        ]
                                    },
                                ]
                            }
                        }
                    },
                },
            },
            "checkpoint": {"uri": "s3://b/p", "everySteps": 10, "keepLast": 2},
            **overrides,
        },
    }
    return JobSpec.from_body(body)


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def build(rank: int = 1, **kw: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "attempt": 3,
        "replicas": 2,
        "master_addr": "127.0.5.1",
        "resume_step": 120,
        "avoid_nodes": ["n2", "n1"],
    }
    args.update(kw)
    return manifests.pod_manifest(spec(), CONFIG, rank=rank, **args)


def trainer(pod: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod["spec"]["containers"] if c["name"] == "trainer")


def test_env_contract_for_a_worker_rank() -> None:
    env = env_of(trainer(build(rank=1)))
    assert env["RANK"] == "1"
    assert env["WORLD_SIZE"] == "2"
    assert env["LOCAL_RANK"] == "0"
    assert env["LOCAL_WORLD_SIZE"] == "1"
    assert env["MASTER_ADDR"] == "127.0.5.1"
    assert env["MASTER_PORT"] == "29500"
    assert env["BATON_CHECKPOINT_URI"] == "s3://b/p"
    assert env["BATON_RESUME_STEP"] == "120"
    assert env["BATON_JOB"] == "ml/tiny"
    assert env["BATON_ATTEMPT"] == "3"
    assert env["BATON_CONTROL_DIR"] == manifests.CONTROL_DIR
    assert env["BATON_EVERY_STEPS"] == "10"
    assert env["BATON_KEEP_LAST"] == "2"
    assert "BATON_EVERY_SECONDS" not in env
    assert env["LR"] == "1", "user env is kept"
    names = [e["name"] for e in trainer(build(rank=1))["env"]]
    assert names.count("RANK") == 1, "a user RANK must not shadow the operator's"


def test_rank0_reads_its_own_ip_and_first_attempt_has_no_resume_step() -> None:
    env = env_of(trainer(build(rank=0, master_addr=None, resume_step=None)))
    assert env["MASTER_ADDR"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["RANK"] == "0"
    assert "BATON_RESUME_STEP" not in env


def test_worker_rank_needs_the_master_address() -> None:
    with pytest.raises(ValueError, match="create rank 0 first"):
        build(rank=1, master_addr=None)


def test_procs_per_replica_sets_torchrun_env_and_leaves_rank_to_the_launcher() -> None:
    s = spec(procsPerReplica=4)
    pod = manifests.pod_manifest(
        s, CONFIG, attempt=0, rank=1, replicas=2, master_addr="10.0.0.1", resume_step=None
    )
    env = env_of(trainer(pod))
    assert env["WORLD_SIZE"] == "8"
    assert env["LOCAL_WORLD_SIZE"] == "4"
    assert env["NODE_RANK"] == "1"
    assert env["NNODES"] == "2"
    # What `torchrun train.py` reads as its defaults.
    assert env["PET_NNODES"] == "2"
    assert env["PET_NODE_RANK"] == "1"
    assert env["PET_NPROC_PER_NODE"] == "4"
    assert env["PET_MASTER_ADDR"] == "10.0.0.1"
    assert env["PET_MASTER_PORT"] == env["MASTER_PORT"] == "29500"
    # torchrun gives each worker its RANK and LOCAL_RANK. A pod-wide value would let a plain
    # `python train.py` join as one process of four and hang; without it, it fails at once.
    # The user's RANK=99 in the template is dropped as well.
    assert "RANK" not in env
    assert "LOCAL_RANK" not in env


def test_torchrun_master_of_the_first_pod_is_its_own_ip() -> None:
    s = spec(procsPerReplica=2)
    pod = manifests.pod_manifest(
        s, CONFIG, attempt=0, rank=0, replicas=2, master_addr=None, resume_step=None
    )
    env = env_of(trainer(pod))
    own_ip = {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["PET_MASTER_ADDR"] == env["MASTER_ADDR"] == own_ip
    assert env["PET_NODE_RANK"] == "0"


def test_torchrun_waits_for_a_signal_save_as_long_as_the_kubelet() -> None:
    assert env_of(trainer(build()))["PET_SHUTDOWN_TIMEOUT"] == "30"
    s = spec(procsPerReplica=2)
    template = dict(s.template)
    template["spec"] = {**template["spec"], "terminationGracePeriodSeconds": 120}
    pod = manifests.pod_manifest(
        replace(s, template=template), CONFIG, attempt=0, rank=0, replicas=1,
        master_addr=None, resume_step=None,
    )  # fmt: skip
    assert env_of(trainer(pod))["PET_SHUTDOWN_TIMEOUT"] == "120"
    # A value the user set is theirs.
    containers = [dict(c) for c in template["spec"]["containers"]]
    containers[0]["env"] = [{"name": "PET_SHUTDOWN_TIMEOUT", "value": "5"}]
    template["spec"] = {**template["spec"], "containers": containers}
    pod = manifests.pod_manifest(
        replace(s, template=template), CONFIG, attempt=0, rank=0, replicas=1,
        master_addr=None, resume_step=None,
    )  # fmt: skip
    env = trainer(pod)["env"]
    assert [e["value"] for e in env if e["name"] == "PET_SHUTDOWN_TIMEOUT"] == ["5"]


def test_one_process_per_pod_keeps_rank_and_also_suits_torchrun() -> None:
    env = env_of(trainer(build(rank=1)))
    assert (env["RANK"], env["LOCAL_RANK"]) == ("1", "0")
    assert (env["PET_NNODES"], env["PET_NODE_RANK"], env["PET_NPROC_PER_NODE"]) == ("2", "1", "1")


def test_names_labels_and_owner() -> None:
    pod = build(rank=1)
    meta = pod["metadata"]
    assert meta["name"] == "tiny-a3-r1"
    assert meta["namespace"] == "ml"
    assert meta["labels"] == {
        "team": "a",
        "baton.dev/job": "tiny",
        "baton.dev/attempt": "3",
        "baton.dev/rank": "1",
        "app.kubernetes.io/managed-by": "baton",
    }
    assert meta["annotations"] == {"note": "x"}
    (owner,) = meta["ownerReferences"]
    assert owner == {
        "apiVersion": "baton.dev/v1alpha1",
        "kind": "TrainingJob",
        "name": "tiny",
        "uid": "u-1",
        "controller": True,
    }
    assert pod["spec"]["restartPolicy"] == "Never"


def test_native_sidecar_and_shared_volumes() -> None:
    pod = build()
    (sidecar,) = pod["spec"]["initContainers"]
    assert sidecar["name"] == "baton-sidecar"
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["image"] == "baton:test"
    assert sidecar["command"] == ["baton-sidecar", "-v"]
    senv = env_of(sidecar)
    assert senv["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert senv["BATON_SIDECAR_PORT"] == "9440"
    assert senv["BATON_SIDECAR_TOKEN_FILE"] == "/var/run/baton/token/token"
    assert senv["BATON_CONTROL_DIR"] == "/var/run/baton/control"
    mounts = {m["name"]: m for m in sidecar["volumeMounts"]}
    assert mounts["baton-token"]["readOnly"] is True
    assert mounts["baton-control"]["mountPath"] == "/var/run/baton/control"
    tmounts = {m["name"]: m["mountPath"] for m in trainer(pod)["volumeMounts"]}
    assert tmounts == {"baton-control": "/var/run/baton/control"}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["baton-control"] == {"name": "baton-control", "emptyDir": {}}
    assert volumes["baton-token"]["secret"]["secretName"] == "tiny-sidecar-token"
    assert not any("hostPath" in v for v in pod["spec"]["volumes"])


def test_the_token_file_is_group_only_and_the_sidecar_has_the_group() -> None:
    # Mode 0440: the kubelet makes the pod's fsGroup the file's group and gives every
    # container that group, so the sidecar reads it whatever non-root user its image runs
    # as; other users cannot. With no fsGroup in the template the operator sets one (and
    # keeps the kubelet from re-owning the user's volumes on every start).
    pod = build()
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["baton-token"]["secret"]["defaultMode"] == 0o440
    pod_ctx = pod["spec"]["securityContext"]
    assert pod_ctx["fsGroup"] == manifests.DEFAULT_FS_GROUP == 65532
    assert pod_ctx["fsGroupChangePolicy"] == "OnRootMismatch"
    # A template's own fsGroup (and change policy) is kept: the token then has that group.
    template = copy.deepcopy(dict(spec().template))
    template["spec"]["securityContext"] = {"fsGroup": 1000}
    own = manifests.pod_manifest(
        spec(template=template), CONFIG, rank=0, attempt=0, replicas=2, master_addr=None,
        resume_step=None,
    )  # fmt: skip
    assert own["spec"]["securityContext"]["fsGroup"] == 1000
    assert "fsGroupChangePolicy" not in own["spec"]["securityContext"]
    (sidecar,) = pod["spec"]["initContainers"]
    assert sidecar["securityContext"]["readOnlyRootFilesystem"] is True
    for probe in ("startupProbe", "livenessProbe"):
        assert sidecar[probe]["httpGet"] == {"path": "/healthz", "port": 9440}, probe
    assert sidecar["resources"]["requests"]["memory"] == "48Mi"


def test_restricted_security_on_every_container() -> None:
    pod = build()
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    everything = pod["spec"]["containers"] + pod["spec"]["initContainers"]
    assert len(everything) == 3
    for c in everything:
        ctx = c["securityContext"]
        assert ctx["allowPrivilegeEscalation"] is False, c["name"]
        assert ctx["capabilities"] == {"drop": ["ALL"]}, c["name"]
        assert ctx["runAsNonRoot"] is True, c["name"]
        assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}, c["name"]
    assert trainer(pod)["securityContext"]["runAsUser"] == 1000, "user fields are kept"
    assert pod["spec"]["automountServiceAccountToken"] is False


def test_restricted_settings_fill_in_what_is_unset_and_rewrite_nothing() -> None:
    """The template's own allowed values stay as written (podpolicy.py refused every value
    that contradicts restricted); only unset fields get restricted's value."""
    job = spec()
    template = copy.deepcopy(dict(job.template))
    localhost = {"type": "Localhost", "localhostProfile": "profiles/train.json"}
    template["spec"]["securityContext"] = {"seccompProfile": localhost, "runAsNonRoot": True}
    template["spec"]["containers"][0]["securityContext"] = {
        "capabilities": {"add": ["NET_BIND_SERVICE"]},
        "seccompProfile": localhost,
        "allowPrivilegeEscalation": False,
    }
    template["spec"]["containers"][1]["securityContext"] = {
        "capabilities": {"drop": ["ALL", "NET_RAW"]}
    }
    pod = manifests.pod_manifest(
        replace(job, template=template), CONFIG, attempt=0, rank=0, replicas=2,
        master_addr=None, resume_step=None,
    )  # fmt: skip
    assert pod["spec"]["securityContext"]["seccompProfile"] == localhost
    ctx = trainer(pod)["securityContext"]
    assert ctx["seccompProfile"] == localhost
    assert ctx["capabilities"] == {"add": ["NET_BIND_SERVICE"], "drop": ["ALL"]}
    assert ctx["runAsNonRoot"] is True
    logger = pod["spec"]["containers"][1]["securityContext"]
    assert logger["capabilities"] == {"drop": ["ALL", "NET_RAW"]}
    assert logger["allowPrivilegeEscalation"] is False


def test_affinity_avoids_noticed_nodes_in_every_term_and_spreads_ranks() -> None:
    pod = build(avoid_nodes=["n2", "n1", "n2"])
    terms = pod["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert len(terms) == 2, "the user's terms are kept"
    for term in terms:
        # One value per requirement: the API server refuses a node field selector with more
        # (a second preemption in a row used to leave the job Pending on a 422).
        assert term["matchFields"] == [
            {"key": "metadata.name", "operator": "NotIn", "values": ["n1"]},
            {"key": "metadata.name", "operator": "NotIn", "values": ["n2"]},
        ]
        assert term["matchExpressions"], "the user's expressions are kept"
    (anti,) = pod["spec"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    assert anti["labelSelector"]["matchLabels"] == {
        "baton.dev/job": "tiny",
        "baton.dev/attempt": "3",
    }


def test_no_avoided_nodes_adds_no_node_affinity() -> None:
    s = spec(template={"spec": {"containers": [{"name": "trainer", "image": "t"}]}})
    pod = manifests.pod_manifest(
        s, CONFIG, attempt=0, rank=0, replicas=1, master_addr=None, resume_step=None
    )
    assert "nodeAffinity" not in pod["spec"]["affinity"]


def test_tolerations_pass_through_and_only_the_operator_removes_a_lost_nodes_pods() -> None:
    """Unreachable and not-ready are tolerated without end: the taint manager's timed
    eviction deletes by name and hit the operator's same-named replacement (#26)."""
    tolerations = build()["spec"]["tolerations"]
    assert {"key": "gpu", "operator": "Exists"} in tolerations
    lost = {t["key"]: t for t in tolerations if t.get("effect") == "NoExecute"}
    assert set(lost) == {"node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready"}
    for t in lost.values():
        assert t == {"key": t["key"], "operator": "Exists", "effect": "NoExecute"}


def test_template_without_trainer_is_refused() -> None:
    s = spec(template={"spec": {"containers": [{"name": "main", "image": "t"}]}})
    with pytest.raises(ValueError, match="trainer"):
        manifests.pod_manifest(
            s, CONFIG, attempt=0, rank=0, replicas=1, master_addr=None, resume_step=None
        )


def test_service_secret_and_selector() -> None:
    s = spec()
    svc = manifests.service_manifest(s)
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {
        "baton.dev/job": "tiny",
        "app.kubernetes.io/managed-by": "baton",
    }
    assert svc["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    secret = manifests.token_secret_manifest(s, "tok")
    assert secret["metadata"]["name"] == "tiny-sidecar-token"
    assert secret["stringData"] == {"token": "tok"}
    assert secret["metadata"]["ownerReferences"][0]["kind"] == "TrainingJob"
    assert manifests.job_selector("tiny", 2) == (
        "baton.dev/job=tiny,app.kubernetes.io/managed-by=baton,baton.dev/attempt=2"
    )


def test_builders_do_not_mutate_the_template() -> None:
    s = spec()
    before = repr(s.template)
    build()
    manifests.pod_manifest(
        s,
        CONFIG,
        attempt=1,
        rank=0,
        replicas=2,
        master_addr=None,
        resume_step=None,
        avoid_nodes=["x"],
    )
    assert repr(s.template) == before


def test_kueue_metadata_joins_the_templates_own_and_names_the_attempts_group() -> None:
    queued = replace(spec(), queue_labels={"kueue.x-k8s.io/queue-name": "team-a"})
    pod = manifests.pod_manifest(
        queued, CONFIG, attempt=3, rank=1, replicas=2, master_addr="127.0.5.1", resume_step=None
    )
    meta = pod["metadata"]
    assert meta["labels"]["team"] == "a", "the template's labels stay"
    assert meta["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert meta["labels"][manifests.KUEUE_GROUP_LABEL] == "tiny-a3"
    assert meta["annotations"] == {
        "note": "x",
        manifests.KUEUE_GROUP_COUNT_ANNOTATION: "2",
        manifests.KUEUE_RETRIABLE_ANNOTATION: "false",
    }
    # A label value has at most 63 characters: a long job name keeps its head and a digest,
    # distinct per attempt.
    long = "j" * 80
    groups = {manifests.kueue_group(long, a) for a in range(3)}
    assert len(groups) == 3
    assert all(len(g) <= 63 and g.startswith("j" * 40) for g in groups)
    assert "kueue.x-k8s.io/pod-group-name" not in build()["metadata"]["labels"]


# ----------------------------------------------------------------- gang scheduling


def test_pod_group_is_a_gang_of_every_pod_of_the_attempt_owned_by_the_job() -> None:
    group = manifests.pod_group_manifest(spec(), attempt=3, replicas=4)
    assert group["apiVersion"] == "scheduling.k8s.io/v1beta1"
    assert group["kind"] == "PodGroup"
    assert group["metadata"]["name"] == "tiny-a3" == manifests.kueue_group("tiny", 3)
    assert group["metadata"]["namespace"] == "ml"
    assert group["metadata"]["labels"] == {
        "baton.dev/job": "tiny",
        "baton.dev/attempt": "3",
        "app.kubernetes.io/managed-by": "baton",
    }
    (owner,) = group["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("TrainingJob", "u-1", True)
    assert group["spec"] == {"schedulingPolicy": {"gang": {"minCount": 4}}}


def test_a_long_jobs_pod_group_is_its_kueue_group_within_63_characters() -> None:
    name = "j" * 70
    assert manifests.pod_group_name(name, 12) == manifests.kueue_group(name, 12)
    assert len(manifests.pod_group_name(name, 12)) <= 63


def test_gang_pods_link_to_the_group_and_meet_at_rank_0s_dns_name() -> None:
    domain = OperatorConfig(cluster_domain="k8s.corp.internal")
    master = manifests.master_dns_name(spec(), domain, 3)
    assert master == "tiny-a3-r0.tiny.ml.svc.k8s.corp.internal"
    assert manifests.master_dns_name(spec(), CONFIG, 3).endswith(".ml.svc.cluster.local")
    rank0 = build(rank=0, master_addr=master, pod_group="tiny-a3")
    rank1 = build(rank=1, master_addr=master, pod_group="tiny-a3")
    for pod in (rank0, rank1):
        assert pod["spec"]["schedulingGroup"] == {"podGroupName": "tiny-a3"}
    # The name is rank 0's hostname under the job's subdomain (the headless Service).
    assert (rank0["spec"]["hostname"], rank0["spec"]["subdomain"]) == ("tiny-a3-r0", "tiny")
    assert master.startswith(f"{rank0['spec']['hostname']}.{rank0['spec']['subdomain']}.ml.")
    for pod in (rank0, rank1):
        env = env_of(trainer(pod))
        assert env["MASTER_ADDR"] == env["PET_MASTER_ADDR"] == master, "one rendezvous name"
    assert "schedulingGroup" not in build(rank=1)["spec"], "no group: no link"


def test_a_template_hostname_and_subdomain_name_the_master() -> None:
    s = spec()
    template = copy.deepcopy(dict(s.template))
    template["spec"].update(hostname="h", subdomain="sub")
    s = replace(s, template=template)
    assert manifests.master_dns_name(s, CONFIG, 0) == "h.sub.ml.svc.cluster.local"


def test_the_cluster_domain_must_be_a_bare_domain() -> None:
    for bad in ("", ".cluster.local", "cluster.local."):
        with pytest.raises(ValueError, match="--cluster-domain"):
            OperatorConfig(cluster_domain=bad)
