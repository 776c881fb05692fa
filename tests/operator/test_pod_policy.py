"""The security policy: every escalating pod-template field is refused, by the operator's own
check (podpolicy.refusals) and, where a schema can say it, by the CRD's CEL rules at admission.

The CEL rules are evaluated here with cel-python on every object node they apply to (array items
included); ``test_security_cluster.py`` checks that the API server refuses
the same templates on the local cluster.
"""

from __future__ import annotations

import copy
from typing import Any

import celpy
import pytest
from baton_operator.pure import crd, podpolicy
from baton_operator.pure.podpolicy import PodPolicy
from baton_testing.escalations import (
    ALLOWED,
    CONTAINER_KINDS,
    CONTAINER_ONLY,
    CONTEXT_FIELDS,
    ESCALATIONS,
    REFUSED_VOLUMES,
    P,
    plain_template,
)
from celpy.adapter import json_to_cel


def test_a_plain_template_is_allowed() -> None:
    assert podpolicy.refusals(plain_template(), PodPolicy()) == []


@pytest.mark.parametrize("case", sorted(ESCALATIONS))
def test_the_operator_refuses_each_escalation_naming_the_field(case: str) -> None:
    mutate, field, _ = ESCALATIONS[case]
    template = plain_template()
    mutate(template)
    (refusal,) = podpolicy.refusals(template, PodPolicy())
    assert refusal.field == field
    message = podpolicy.summary([refusal])
    assert field in message
    assert "Remove these fields" in message


def test_every_escalation_at_once_is_refused_field_by_field() -> None:
    template = plain_template()
    # One volume and one probe handler per container at a time (each case sets the whole list).
    cases = {k: v for k, v in ESCALATIONS.items() if not k.startswith("volume ")}
    cases = {k: v for k, v in cases.items() if not k.endswith(".host")}
    for mutate, _, _ in cases.values():
        mutate(template)
    template["spec"]["serviceAccountName"] = "kube-admin"
    found = {r.field for r in podpolicy.refusals(template, PodPolicy())}
    assert found == {f for _, f, _ in cases.values()} | {f"{P}.serviceAccountName"}


def test_false_and_empty_values_are_not_escalations() -> None:
    template = plain_template()
    spec = template["spec"]
    spec.update(hostNetwork=False, hostPID=False, hostIPC=False, nodeName="")
    spec["containers"][0]["securityContext"].update(privileged=False)
    spec["containers"][0]["securityContext"]["capabilities"]["add"] = []
    spec["containers"][0]["ports"].append({"containerPort": 1, "hostPort": 0})
    spec["containers"][0]["livenessProbe"] = {"httpGet": {"host": "", "port": 80}}
    spec["ephemeralContainers"] = []
    assert podpolicy.refusals(template, PodPolicy()) == []
    assert _cel_violations(_job(template)) == []


@pytest.mark.parametrize("case", sorted(ALLOWED))
def test_what_restricted_allows_passes_both_checks(case: str) -> None:
    template = plain_template()
    ALLOWED[case](template)
    assert podpolicy.refusals(template, PodPolicy()) == []
    assert _cel_violations(_job(template)) == []


def test_the_policy_covers_every_pod_security_check() -> None:
    """Each PSA baseline/restricted check has cases here, in every container kind."""
    for kind in CONTAINER_KINDS:
        for field in (*CONTEXT_FIELDS, *CONTAINER_ONLY, "hostPort"):
            assert f"{kind} {field}" in ESCALATIONS, (kind, field)
    for field in CONTEXT_FIELDS:
        assert f"pod {field}" in ESCALATIONS
    assert {f"volume {v}" for v in REFUSED_VOLUMES} <= set(ESCALATIONS)
    assert len(ESCALATIONS) > 100


@pytest.mark.parametrize("key", ["serviceAccountName", "serviceAccount"])
def test_service_accounts_outside_the_allow_list_are_refused(key: str) -> None:
    template = plain_template()
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
    assert _cel_violations(_job(plain_template())) == []


@pytest.mark.parametrize("case", sorted(ESCALATIONS))
def test_cel_refuses_each_escalation_naming_the_field(case: str) -> None:
    mutate, field, cel_field = ESCALATIONS[case]
    template = plain_template()
    mutate(template)
    (message,) = _cel_violations(_job(template))
    # CEL messages name the list, not the index (one rule serves every item).
    generic = cel_field or field.replace("[0]", "[]").replace("[1]", "[]")
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
    template = copy.deepcopy(plain_template())
    template["spec"]["serviceAccountName"] = "ci-deployer"
    assert _cel_violations(_job(template)) == []
