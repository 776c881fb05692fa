"""The TrainingJob CRD: structural schema, printer columns, and every CEL rule's verdicts.

The CEL rules are evaluated here with cel-python against good and bad objects, so a rule that
never fires (or always fires) is caught without a cluster; the cluster tests then check that
the API server refuses the same objects with the same messages.
"""

from __future__ import annotations

import copy
from typing import Any

import celpy
import pytest
from baton_operator.pure import crd
from celpy.adapter import json_to_cel

from trainer_sdk.loop._config import CheckpointerConfig


def _schema() -> dict[str, Any]:
    version = crd.crd_manifest()["spec"]["versions"][0]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def _walk(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path, node)]
    for name, child in (node.get("properties") or {}).items():
        out.extend(_walk(child, f"{path}.{name}"))
    if "items" in node:
        out.extend(_walk(node["items"], f"{path}[]"))
    return out


def _gpus(job: dict[str, Any], *, procs: int, gpus: int | str, name: str = "trainer") -> None:
    job["spec"]["procsPerReplica"] = procs
    job["spec"]["template"]["spec"]["containers"] = [
        {"name": "logger" if name == "trainer" else "trainer", "image": "x"},
        {"name": name, "image": "x", "resources": {"limits": {"nvidia.com/gpu": gpus}}},
    ]


def valid_job() -> dict[str, Any]:
    return {
        "apiVersion": "baton.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "tiny", "namespace": "default"},
        "spec": {
            "replicas": 2,
            "procsPerReplica": 1,
            "minReplicas": 1,
            "template": {"spec": {"containers": [{"name": "trainer", "image": "x"}]}},
            "checkpoint": {"uri": "s3://bucket/prefix", "everySteps": 10},
        },
    }


def _rules(schema: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path, node in _walk(schema):
        for rule in node.get("x-kubernetes-validations") or []:
            found.append((path, rule))
    return found


def _node_at(obj: Any, path: str) -> Any:
    for part in [p for p in path.split(".") if p]:
        if obj is None:
            return None
        obj = obj.get(part)
    return obj


def _violations(new: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    """Messages of every CEL rule that ``new`` (updated from ``old``) violates."""
    env = celpy.Environment()
    messages = []
    for path, rule in _rules(_schema()):
        self_value = _node_at(new, path)
        if self_value is None:
            continue  # CEL rules only run on fields that are present
        if "oldSelf" in rule["rule"]:
            old_value = None if old is None else _node_at(old, path)
            if old_value is None:
                continue  # transition rules run on updates only
        activation = {"self": json_to_cel(self_value)}
        if "oldSelf" in rule["rule"]:
            activation["oldSelf"] = json_to_cel(old_value)
        result = env.program(env.compile(rule["rule"])).evaluate(activation)
        if not bool(result):
            messages.append(rule["message"])
    return messages


def test_a_valid_job_passes_every_rule() -> None:
    assert _violations(valid_job()) == []


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda j: (j["spec"].update(replicas=0), j["spec"].pop("minReplicas")), "spec.replicas"),
        (lambda j: j["spec"].update(minReplicas=3), "spec.minReplicas"),
        (lambda j: j["spec"].update(minReplicas=0), "spec.minReplicas"),
        (lambda j: j["spec"]["checkpoint"].update(uri="gs://bucket/x"), "spec.checkpoint.uri"),
        (lambda j: j["spec"]["checkpoint"].update(uri="relative/dir"), "spec.checkpoint.uri"),
        (lambda j: j["spec"]["checkpoint"].update(everySteps=0), "spec.checkpoint.everySteps"),
        (lambda j: j["spec"]["checkpoint"].update(everySeconds=0), "spec.checkpoint.everySeconds"),
        (
            lambda j: j["spec"]["checkpoint"].update(everySeconds="fast"),
            "spec.checkpoint.everySeconds",
        ),
        (
            lambda j: j["spec"]["template"]["spec"].update(containers=[{"name": "main"}]),
            "spec.template.spec.containers",
        ),
        (lambda j: j["spec"].update(procsPerReplica=1000), "spec.procsPerReplica"),
        (lambda j: _gpus(j, procs=8, gpus=4), "spec.procsPerReplica"),
        (lambda j: _gpus(j, procs=8, gpus="4"), "spec.procsPerReplica"),
    ],
)
def test_each_rule_refuses_its_invalid_value_naming_the_field(mutate: Any, field: str) -> None:
    job = valid_job()
    mutate(job)
    messages = _violations(job)
    assert len(messages) == 1, messages
    assert messages[0].startswith(field)


@pytest.mark.parametrize(
    ("procs", "gpus", "name"),
    [
        (8, 8, "trainer"),  # the usual 8-GPU pod
        (8, "8", "trainer"),  # quoted quantities too
        (2, 8, "trainer"),  # fewer processes than GPUs (model parallel inside a process)
        (64, 0, "trainer"),  # 0 GPUs: a CPU job
        (8, 1, "helper"),  # only the trainer's GPUs count
    ],
)
def test_procs_per_replica_within_the_gpus_is_accepted(
    procs: int, gpus: int | str, name: str
) -> None:
    job = valid_job()
    _gpus(job, procs=procs, gpus=gpus, name=name)
    assert _violations(job) == []


@pytest.mark.parametrize("every_seconds", [1, 600, "auto"])
def test_every_seconds_takes_a_positive_number_or_auto(every_seconds: int | str) -> None:
    job = valid_job()
    job["spec"]["checkpoint"]["everySeconds"] = every_seconds
    assert _violations(job) == []
    node = _schema()["properties"]["spec"]["properties"]["checkpoint"]["properties"]
    assert node["everySeconds"]["x-kubernetes-int-or-string"] is True


def test_procs_per_replica_messages_name_the_field_and_the_fix() -> None:
    job = valid_job()
    _gpus(job, procs=8, gpus=2)
    (message,) = _violations(job)
    assert "resources.limits[nvidia.com/gpu]" in message
    assert "lower spec.procsPerReplica or request more GPUs" in message
    job = valid_job()
    job["spec"]["procsPerReplica"] = 65
    (message,) = _violations(job)
    assert "at most 64" in message


@pytest.mark.parametrize("uri", ["s3://b/p", "file:///data/ckpt", "/data/ckpt"])
def test_uri_schemes_that_are_accepted(uri: str) -> None:
    job = valid_job()
    job["spec"]["checkpoint"]["uri"] = uri
    assert _violations(job) == []


@pytest.mark.parametrize(
    ("field", "mutate"),
    [
        ("spec.replicas", lambda j: j["spec"].update(replicas=3)),
        ("spec.procsPerReplica", lambda j: j["spec"].update(procsPerReplica=2)),
        ("spec.checkpoint.uri", lambda j: j["spec"]["checkpoint"].update(uri="s3://other/p")),
    ],
)
def test_fields_are_immutable_once_started_but_not_before(field: str, mutate: Any) -> None:
    old = valid_job()
    new = copy.deepcopy(old)
    mutate(new)
    # Before the operator has set a phase the job may still be edited.
    assert _violations(new, old) == []
    old["status"] = {"phase": "Running"}
    new["status"] = {"phase": "Running"}
    messages = _violations(new, old)
    assert len(messages) == 1
    assert messages[0].startswith(f"{field} is immutable")


def test_schema_is_structural_and_explained() -> None:
    for path, node in _walk(_schema()):
        preserve = node.get("x-kubernetes-preserve-unknown-fields")
        # An int-or-string field is the one structural node without a type (Kubernetes
        # checks it as "integer or string" itself).
        int_or_string = node.get("x-kubernetes-int-or-string") is True
        assert "type" in node or int_or_string, f"{path or '<root>'} has no type (not structural)"
        if path.startswith((".spec", ".status")) and path.count(".") >= 1:
            assert node.get("description") or path.endswith("[]"), f"{path} has no description"
        if preserve:
            assert node["type"] == "object"
    spec = _schema()["properties"]["spec"]
    # Required through CEL (crd._required), not the schema: see the test below.
    assert "required" not in spec


def test_every_rule_has_a_message_and_a_field_path() -> None:
    rules = _rules(_schema())
    # The security policy's rules (podpolicy.forbid_in_schema; tests/operator/test_pod_policy.py):
    # 1 on the template's AppArmor annotations; 7 on the pod spec and 9 on its security
    # context; on each container list 13 on the security context, 1 hostPort, 10 probe and
    # hook hosts.
    policy = [r for _, r in rules if r["message"].endswith("(docs/operator.md, Security policy)")]
    assert len(policy) == 1 + 7 + 9 + 2 * (13 + 1 + 10)
    rules = [(p, r) for p, r in rules if r not in policy]
    # 2 name + 3 immutability + 3 required + 5 spec + 1 template + 7 checkpoint (1 required)
    assert len(rules) == 21
    for path, rule in rules:
        assert rule["message"], f"rule at {path} has no message"
        assert rule["fieldPath"].startswith("."), f"rule at {path} has no fieldPath"


def test_status_declares_every_field_the_operator_writes() -> None:
    status = _schema()["properties"]["status"]["properties"]
    for name in (
        "phase",
        "attempt",
        "worldSize",
        "replicas",
        "preemptions",
        "failures",
        "resumedFromStep",
        "observedGeneration",
        "lastCheckpoint",
        "conditions",
        "notice",
        "avoidNodes",
        "masterAddr",
        "restartAfter",
        "restartReason",
        "unschedulableSince",
        "attemptStartedAt",
        "message",
        "stepsLost",
        "checkpointInterval",
        "suspendedAt",
    ):
        assert name in status, f"status.{name} would be pruned by the API server"
    assert set(status["lastCheckpoint"]["properties"]) == {
        "step",
        "uri",
        "trigger",
        "completedAt",
        "seconds",
        "tier",
    }
    assert status["lastCheckpoint"]["properties"]["tier"]["enum"] == [
        "durable",
        "memory",
        "memory+promoted",
    ]
    assert status["phase"]["enum"] == list(crd.PHASES)


def test_suspend_is_a_mutable_boolean_that_defaults_to_false() -> None:
    schema = _schema()
    suspend = schema["properties"]["spec"]["properties"]["suspend"]
    assert (suspend["type"], suspend["default"]) == ("boolean", False)
    assert "Suspended" in crd.PHASES
    immutable = " ".join(r["rule"] for r in schema["x-kubernetes-validations"])
    assert "suspend" not in immutable, "Kueue flips spec.suspend on a running job"


def test_names_columns_and_subresources() -> None:
    manifest = crd.crd_manifest()
    assert manifest["metadata"]["name"] == "trainingjobs.baton.dev"
    assert manifest["spec"]["names"]["shortNames"] == ["tj"]
    version = manifest["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Phase"] == ".status.phase"
    assert columns["World"] == ".status.worldSize"
    assert columns["Checkpoint"] == ".status.lastCheckpoint.step"
    assert columns["Preemptions"] == ".status.preemptions"
    assert columns["Failures"] == ".status.failures"
    assert columns["Age"] == ".metadata.creationTimestamp"
    assert columns["Step"] == ".status.goodput.step"
    assert columns["Reason"] == ".status.reason"
    assert columns["Message"] == ".status.message"
    priority = {c["name"]: c.get("priority", 0) for c in version["additionalPrinterColumns"]}
    assert (priority["Step"], priority["Reason"], priority["Message"]) == (0, 0, 1)
    assert "reason" in _schema()["properties"]["status"]["properties"]


def test_explain_says_what_int_or_string_fields_take_and_the_defaults_applied_in_code() -> None:
    ckpt = _schema()["properties"]["spec"]["properties"]["checkpoint"]["properties"]
    assert ckpt["everySeconds"]["description"].startswith(
        "A number of seconds or the string `auto`"
    )
    sdk_default = CheckpointerConfig.__dataclass_fields__["keep_last"].default
    assert f"Default: {sdk_default} " in ckpt["keepLast"]["description"]
    # No schema default: `kubectl describe` of a job without the memory tier would show
    # `Fast Replicas: 1`; the operator applies the 1 when the tier is on (model.py).
    assert "default" not in ckpt["fastReplicas"]
    assert "Default: 1 when the memory tier is on" in ckpt["fastReplicas"]["description"]


@pytest.mark.parametrize(
    ("path", "field"),
    [
        (("replicas",), "spec.replicas"),
        (("template",), "spec.template"),
        (("checkpoint",), "spec.checkpoint"),
        (("checkpoint", "uri"), "spec.checkpoint.uri"),
        (("template", "spec"), "spec.template.spec.containers"),
        (("template", "spec", "containers"), "spec.template.spec.containers"),
    ],
)
def test_a_missing_required_field_is_one_message_naming_it(
    path: tuple[str, ...], field: str
) -> None:
    """Required through CEL: a schema `required` makes the API server skip every CEL rule and
    add a line of its own ("<nil>: Invalid value: null: some validation rules were not
    checked"); test_admission_cluster.py checks the API server's own words."""
    job = valid_job()
    job["spec"].pop("minReplicas")
    node = job["spec"]
    for part in path[:-1]:
        node = node[part]
    del node[path[-1]]
    messages = _violations(job)
    assert len(messages) == 1, messages
    assert messages[0].startswith(field), messages


def test_transition_rules_leave_an_absent_field_to_the_rule_that_requires_it() -> None:
    old = valid_job()
    old["status"] = {"phase": "Running"}
    new = copy.deepcopy(old)
    del new["spec"]["checkpoint"]
    assert _violations(new, old) == [
        "spec.checkpoint is required: at least its uri, e.g. s3://bucket/prefix"
    ]


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("my.job", "DNS-1035"),
        ("My-job", "DNS-1035"),
        ("1job", "DNS-1035"),
        ("job-", "DNS-1035"),
        ("my_job", "DNS-1035"),
        ("j" * 64, "at most 63 characters"),
    ],
)
def test_a_name_that_is_not_a_dns_label_is_refused_naming_the_fix(name: str, why: str) -> None:
    job = valid_job()
    job["metadata"]["name"] = name
    messages = _violations(job)
    assert len(messages) == 1, messages
    assert messages[0].startswith("metadata.name must")
    assert why in messages[0]
    assert "rename" in messages[0] or "shorter name" in messages[0]


@pytest.mark.parametrize("name", ["a", "my-job", "j" * 63, "job-" + "x" * 53])
def test_dns_label_names_up_to_63_characters_are_admitted(name: str) -> None:
    job = valid_job()
    job["metadata"]["name"] = name
    assert _violations(job) == []


def test_master_port_is_bounded_to_a_tcp_port() -> None:
    port = _schema()["properties"]["spec"]["properties"]["masterPort"]
    assert (port["minimum"], port["maximum"], port["default"]) == (1, 65535, 29500)


def test_crd_manifest_is_a_fresh_copy() -> None:
    a = crd.crd_manifest()
    a["spec"]["group"] = "mutated"
    assert crd.crd_manifest()["spec"]["group"] == "baton.dev"
