"""The security policy: every escalating pod-template field is refused, by the operator's own
check (podpolicy.refusals) and, where a schema can say it, by the CRD's CEL rules at admission.

The CEL rules are evaluated here with cel-python on every object node they apply to (array items
included); ``test_pod_policy_cluster.py`` checks that the API server and the operator refuse
the same templates on the local cluster.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import celpy
import pytest
from baton_operator import crd, podpolicy
from baton_operator.podpolicy import PodPolicy
from celpy.adapter import json_to_cel


def _template() -> dict[str, Any]:
    return {
        "metadata": {"labels": {"team": "ml"}},
        "spec": {
            "serviceAccountName": "default",
            "securityContext": {"runAsUser": 1000, "fsGroup": 1000},
            "volumes": [{"name": "scratch", "emptyDir": {}}],
            "initContainers": [{"name": "fetch", "image": "x", "securityContext": {}}],
            "containers": [
                {
                    "name": "trainer",
                    "image": "x",
                    "ports": [{"containerPort": 29500}],
                    "securityContext": {"runAsUser": 1000, "capabilities": {"drop": ["ALL"]}},
                }
            ],
        },
    }


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(t: dict[str, Any]) -> None:
        node: Any = t["spec"]
        parts = path.split(".")
        for part in parts[:-1]:
            node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
        last = parts[-1]
        if last.isdigit():
            node.append(value)
        else:
            node[last] = value

    return apply


# (what a user writes, the field both checks must name)
ESCALATIONS = {
    "hostNetwork": (_set("hostNetwork", True), "spec.template.spec.hostNetwork"),
    "hostPID": (_set("hostPID", True), "spec.template.spec.hostPID"),
    "hostIPC": (_set("hostIPC", True), "spec.template.spec.hostIPC"),
    "hostPath": (
        _set("volumes.1", {"name": "root", "hostPath": {"path": "/"}}),
        "spec.template.spec.volumes[1].hostPath",
    ),
    "nodeName": (_set("nodeName", "spot-1"), "spec.template.spec.nodeName"),
    "pod runAsUser 0": (
        _set("securityContext.runAsUser", 0),
        "spec.template.spec.securityContext.runAsUser",
    ),
    "container runAsUser 0": (
        _set("containers.0.securityContext.runAsUser", 0),
        "spec.template.spec.containers[0].securityContext.runAsUser",
    ),
    "privileged": (
        _set("containers.0.securityContext.privileged", True),
        "spec.template.spec.containers[0].securityContext.privileged",
    ),
    "init privileged": (
        _set("initContainers.0.securityContext.privileged", True),
        "spec.template.spec.initContainers[0].securityContext.privileged",
    ),
    "capabilities.add": (
        _set("containers.0.securityContext.capabilities.add", ["SYS_ADMIN"]),
        "spec.template.spec.containers[0].securityContext.capabilities.add",
    ),
    "hostPort": (
        _set("containers.0.ports.1", {"containerPort": 22, "hostPort": 22}),
        "spec.template.spec.containers[0].ports[1].hostPort",
    ),
}


def test_a_plain_template_is_allowed() -> None:
    assert podpolicy.refusals(_template(), PodPolicy()) == []


@pytest.mark.parametrize("case", sorted(ESCALATIONS))
def test_the_operator_refuses_each_escalation_naming_the_field(case: str) -> None:
    mutate, field = ESCALATIONS[case]
    template = _template()
    mutate(template)
    (refusal,) = podpolicy.refusals(template, PodPolicy())
    assert refusal.field == field
    message = podpolicy.summary([refusal])
    assert field in message
    assert "Remove these fields" in message


def test_every_escalation_at_once_is_refused_field_by_field() -> None:
    template = _template()
    for mutate, _ in ESCALATIONS.values():
        mutate(template)
    template["spec"]["serviceAccountName"] = "kube-admin"
    found = {r.field for r in podpolicy.refusals(template, PodPolicy())}
    assert found == {f for _, f in ESCALATIONS.values()} | {"spec.template.spec.serviceAccountName"}


def test_false_and_empty_values_are_not_escalations() -> None:
    template = _template()
    spec = template["spec"]
    spec.update(hostNetwork=False, hostPID=False, hostIPC=False, nodeName="")
    spec["containers"][0]["securityContext"].update(privileged=False)
    spec["containers"][0]["securityContext"]["capabilities"]["add"] = []
    spec["containers"][0]["ports"].append({"containerPort": 1, "hostPort": 0})
    assert podpolicy.refusals(template, PodPolicy()) == []
    assert _cel_violations(_job(template)) == []


@pytest.mark.parametrize("key", ["serviceAccountName", "serviceAccount"])
def test_service_accounts_outside_the_allow_list_are_refused(key: str) -> None:
    template = _template()
    template["spec"].pop("serviceAccountName")
    template["spec"][key] = "ci-deployer"
    (refusal,) = podpolicy.refusals(template, PodPolicy())
    assert refusal.field == f"spec.template.spec.{key}"
    assert "'ci-deployer' is not allowed" in refusal.why
    assert "--allow-service-account" in refusal.why
    allowed = PodPolicy(allowed_service_accounts=("default", "ci-deployer"))
    assert podpolicy.refusals(template, allowed) == []


def test_policy_refuses_an_empty_service_account_name() -> None:
    with pytest.raises(ValueError, match="drop the empty entry"):
        PodPolicy(allowed_service_accounts=("default", ""))


# ----------------------------------------------------------------- the CEL half


def _job(template: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "baton.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "tiny", "namespace": "default"},
        "spec": {
            "replicas": 2,
            "template": template,
            "checkpoint": {"uri": "s3://bucket/prefix"},
        },
    }


def _cel_violations(job: dict[str, Any]) -> list[str]:
    """Messages of every non-transition CEL rule violated anywhere in ``job``."""
    env = celpy.Environment()
    schema = crd.crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    out: list[str] = []

    def visit(node: dict[str, Any], value: Any) -> None:
        if value is None:
            return
        for rule in node.get("x-kubernetes-validations") or []:
            if "oldSelf" in rule["rule"]:
                continue
            program = env.program(env.compile(rule["rule"]))
            if not bool(program.evaluate({"self": json_to_cel(value)})):
                out.append(rule["message"])
        if isinstance(value, dict):
            for name, child in (node.get("properties") or {}).items():
                visit(child, value.get(name))
        if isinstance(value, list) and "items" in node:
            for item in value:
                visit(node["items"], item)

    visit(schema, job)
    return out


def test_cel_accepts_a_plain_template() -> None:
    assert _cel_violations(_job(_template())) == []


@pytest.mark.parametrize("case", sorted(ESCALATIONS))
def test_cel_refuses_each_escalation_naming_the_field(case: str) -> None:
    mutate, field = ESCALATIONS[case]
    template = _template()
    mutate(template)
    (message,) = _cel_violations(_job(template))
    # CEL messages name the list, not the index (one rule serves every item).
    generic = field.replace("[0]", "[]").replace("[1]", "[]")
    assert message.startswith(f"{generic} is not allowed"), message
    assert "Security policy" in message


def test_cel_rules_have_field_paths_and_bounded_lists() -> None:
    schema = crd.crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec = schema["properties"]["spec"]["properties"]["template"]["properties"]["spec"]
    for name in ("volumes", "initContainers", "containers"):
        assert spec["properties"][name]["maxItems"] > 0, name
    for container in (spec["properties"]["containers"], spec["properties"]["initContainers"]):
        item = container["items"]
        assert item["properties"]["ports"]["maxItems"] > 0
        for rule in item["x-kubernetes-validations"]:
            assert rule["fieldPath"].startswith(".")
            assert rule["reason"] == "FieldValueForbidden"


def test_the_schema_does_not_reject_what_the_operator_allows() -> None:
    # A service account is the operator's configuration, not the schema's.
    template = copy.deepcopy(_template())
    template["spec"]["serviceAccountName"] = "ci-deployer"
    assert _cel_violations(_job(template)) == []
