"""The local cluster is a real Kubernetes: API semantics, controllers, admission and node faults.

One cluster serves the whole module (the session fixture ``local_cluster``). Tests that break
nodes add fresh ones first, so the shared nodes stay healthy for later tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest
import urllib3
from baton_testing.cluster import DEFAULT_CONFIG, LocalCluster, LocalClusterError
from kubernetes import client
from kubernetes import watch as k8s_watch
from kubernetes.client.exceptions import ApiException

pytestmark = pytest.mark.cluster

T = TypeVar("T")
ModelT = TypeVar("ModelT")


def build(kind: Callable[[dict[str, Any]], ModelT | None], manifest: dict[str, Any]) -> ModelT:
    """A typed client model from a wire-format manifest (``client.V1Pod.from_dict`` etc.)."""
    built = kind(manifest)
    assert built is not None
    return built


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 60.0) -> T:
    """Poll ``probe`` until it returns something truthy; fail naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.25)


@pytest.fixture
def core(local_cluster: LocalCluster) -> client.CoreV1Api:
    return client.CoreV1Api(local_cluster.api)


@pytest.fixture(scope="module")
def at_module_end() -> Iterator[contextlib.ExitStack]:
    """Checks that wait on the control plane's own slow clocks, run after the module's last
    test (last registered, first run; each one runs, and a failure fails that teardown naming
    what it waited for). Pod GC deletes a pod orphaned by a removed Node only after a fixed 40 s
    quarantine, checked every 20 s (constants of kube-controller-manager's podgc): about 50 s
    in which the module's later tests run instead of a test waiting for nothing else."""
    with contextlib.ExitStack() as stack:
        yield stack


def new_namespace(core: client.CoreV1Api) -> str:
    """A new namespace, returned once its ``default`` ServiceAccount exists.

    The ServiceAccount controller creates it a moment after the namespace, and until then the
    API server refuses every pod there (403: serviceaccount "default" not found), as on any
    cluster: at load 5-7 a pod created at once was refused (fresh-clone run of 3b84fa8).
    """
    name = f"t-{uuid.uuid4().hex[:8]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))

    def default_account() -> bool:
        accounts = core.list_namespaced_service_account(name).items
        return any(a.metadata.name == "default" for a in accounts)

    wait_for(f"the default ServiceAccount of namespace {name}", default_account, timeout=120)
    return name


@pytest.fixture
def namespace(core: client.CoreV1Api) -> Iterator[str]:
    name = new_namespace(core)
    yield name
    core.delete_namespace(name)


def python_container(name: str, script: str) -> dict[str, Any]:
    """A container running ``python -c script`` (python resolves to the project's venv)."""
    return {"name": name, "image": "python", "command": ["python", "-c", textwrap.dedent(script)]}


def pod_manifest(name: str, containers: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {"containers": containers, "terminationGracePeriodSeconds": 5, **spec},
    }


def read_pod(core: client.CoreV1Api, ns: str, name: str) -> dict[str, Any] | None:
    """The pod as its wire-format dict (camelCase keys), or None once it is gone."""
    try:
        return core.read_namespaced_pod(name, ns).to_dict(serialize=True)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def read_node(core: client.CoreV1Api, name: str) -> dict[str, Any]:
    return core.read_node(name).to_dict(serialize=True)


def node_names(core: client.CoreV1Api) -> list[str]:
    return [n["metadata"]["name"] for n in core.list_node().to_dict(serialize=True)["items"]]


def node_ready(node: dict[str, Any]) -> str:
    return str(next(c["status"] for c in node["status"]["conditions"] if c["type"] == "Ready"))


def pod_phase(core: client.CoreV1Api, ns: str, name: str, *phases: str) -> dict[str, Any] | None:
    pod = read_pod(core, ns, name)
    return pod if pod and pod["status"].get("phase") in phases else None


SLEEPER = """
    import signal, time
    signal.signal(signal.SIGTERM, lambda *_: None)  # a job that will not stop on SIGTERM
    print("armed", flush=True)
    while True:
        time.sleep(1)
"""


def test_nodes_are_ready_with_capacity(local_cluster: LocalCluster, core: client.CoreV1Api) -> None:
    nodes = core.list_node().to_dict(serialize=True)["items"]
    cfg = local_cluster.config
    assert len(nodes) >= cfg.nodes
    leases = client.CoordinationV1Api(local_cluster.api)
    for node in nodes:
        name = node["metadata"]["name"]
        assert node_ready(node) == "True", name
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == str(cfg.gpus_per_node)
        assert node["metadata"]["labels"]["kubernetes.io/hostname"] == name
        lease = leases.read_namespaced_lease(name, "kube-node-lease").to_dict(serialize=True)
        assert lease["spec"]["holderIdentity"] == name
    # The version-matched kubectl sees the same nodes.
    out = local_cluster.kubectl("get", "nodes", "-o", "name").stdout.split()
    assert sorted(out) == sorted(f"node/{n['metadata']['name']}" for n in nodes)


def test_pod_runs_command_with_env_and_reports_exit_code(
    local_cluster: LocalCluster, core: client.CoreV1Api, namespace: str
) -> None:
    core.create_namespaced_secret(
        namespace,
        client.V1Secret(
            metadata=client.V1ObjectMeta(name="creds"), string_data={"token": "s3cr3t"}
        ),
    )
    script = """
        import json, os, sys
        keys = ["POD_NAME", "POD_NAMESPACE", "POD_UID", "NODE_NAME", "POD_IP", "APP", "TOKEN",
                "GREETING"]
        print(json.dumps({k: os.environ.get(k) for k in keys}), flush=True)
        sys.exit(3)
    """
    env = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
        {"name": "GREETING", "value": "hello $(POD_NAME)"},
    ]
    container = python_container("main", script) | {"env": env}
    core.create_namespaced_pod(
        namespace,
        build(client.V1Pod.from_dict, pod_manifest("envcheck", [container], restartPolicy="Never")),
    )

    pod = wait_for(
        "the pod to finish", lambda: pod_phase(core, namespace, "envcheck", "Succeeded", "Failed")
    )
    status = pod["status"]
    assert status["phase"] == "Failed"
    state = status["containerStatuses"][0]["state"]["terminated"]
    assert state["exitCode"] == 3
    assert state["reason"] == "Error"
    assert state["finishedAt"] >= state["startedAt"]
    assert status["startTime"]
    ip = status["podIP"]
    assert ip.startswith("127.")
    assert ip != "127.0.0.1"
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions["PodScheduled"] == "True"
    assert conditions["Ready"] == "False"

    # `kubectl logs` goes API server -> node agent's kubelet endpoint -> the log file.
    logs = local_cluster.kubectl("logs", "-n", namespace, "envcheck").stdout
    seen = json.loads(logs.strip().splitlines()[-1])
    assert seen == {
        "POD_NAME": "envcheck",
        "POD_NAMESPACE": namespace,
        "POD_UID": pod["metadata"]["uid"],
        "NODE_NAME": pod["spec"]["nodeName"],
        "POD_IP": ip,
        "APP": "envcheck",
        "TOKEN": "s3cr3t",
        "GREETING": "hello envcheck",
    }


CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.test.baton.dev"},
    "spec": {
        "group": "test.baton.dev",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
        "scope": "Namespaced",
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "required": ["minReplicas", "maxReplicas"],
                                "properties": {
                                    "minReplicas": {"type": "integer", "minimum": 1},
                                    "maxReplicas": {"type": "integer"},
                                },
                                "x-kubernetes-validations": [
                                    {
                                        "rule": "self.minReplicas <= self.maxReplicas",
                                        "message": "minReplicas must not exceed maxReplicas",
                                    }
                                ],
                            }
                        },
                    }
                },
            }
        ],
    },
}


def test_crd_schema_and_cel_rule_reject_invalid_objects(
    local_cluster: LocalCluster, namespace: str
) -> None:
    ext = client.ApiextensionsV1Api(local_cluster.api)
    custom = client.CustomObjectsApi(local_cluster.api)
    try:
        ext.create_custom_resource_definition(
            build(client.V1CustomResourceDefinition.from_dict, CRD)
        )
    except ApiException as e:
        if e.status != 409:
            raise

    def established() -> bool:
        crd = ext.read_custom_resource_definition("widgets.test.baton.dev").to_dict(serialize=True)
        conditions = crd["status"].get("conditions") or []
        return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

    wait_for("the CRD to be established", established)

    def widget(name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return {"apiVersion": "test.baton.dev/v1", "kind": "Widget", "metadata": {"name": name},
                "spec": spec}  # fmt: skip

    def create(body: dict[str, Any]) -> Any:
        return wait_for(
            "the Widget resource to be served",
            lambda: _create_or_error(custom, namespace, body),
            timeout=30,
        )

    ok = create(widget("good", {"minReplicas": 1, "maxReplicas": 2, "unknown": "pruned"}))
    assert isinstance(ok, dict)
    assert "unknown" not in ok["spec"]  # structural schema: unknown fields are pruned

    err = create(widget("bad", {"minReplicas": 3, "maxReplicas": 2}))
    assert isinstance(err, ApiException)
    assert err.status == 422
    assert "minReplicas must not exceed maxReplicas" in str(err.body)

    err = create(widget("bad2", {"minReplicas": 0, "maxReplicas": 2}))
    assert isinstance(err, ApiException)
    assert err.status == 422
    assert "should be greater than or equal to 1" in str(err.body)


def _create_or_error(
    custom: client.CustomObjectsApi, ns: str, body: dict[str, Any]
) -> dict[str, Any] | ApiException | None:
    try:
        created = custom.create_namespaced_custom_object(
            "test.baton.dev", "v1", ns, "widgets", body
        )
    except ApiException as e:
        if e.status == 404:  # discovery of a just-established CRD can lag a moment
            return None
        return e
    assert isinstance(created, dict)
    return created


def test_service_account_with_narrow_role_is_denied_outside_it(
    local_cluster: LocalCluster, core: client.CoreV1Api, namespace: str
) -> None:
    rbac = client.RbacAuthorizationV1Api(local_cluster.api)
    core.create_namespaced_service_account(
        namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="reader"))
    )
    rbac.create_namespaced_role(
        namespace,
        build(
            client.V1Role.from_dict,
            {
                "metadata": {"name": "pod-reader"},
                "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}],
            },
        ),
    )
    rbac.create_namespaced_role_binding(
        namespace,
        build(
            client.V1RoleBinding.from_dict,
            {
                "metadata": {"name": "reader-pods"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "Role",
                    "name": "pod-reader",
                },
                "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}],
            },
        ),
    )
    # The pod logs in as its ServiceAccount through the kubeconfig the node agent writes.
    script = """
        import json, os
        from kubernetes import client, config
        from kubernetes.client.exceptions import ApiException
        config.load_kube_config()
        v1 = client.CoreV1Api()
        ns = os.environ["POD_NAMESPACE"]
        def status(call):
            try:
                call()
                return 200
            except ApiException as e:
                return e.status
        print(json.dumps({
            "own_pods": status(lambda: v1.list_namespaced_pod(ns)),
            "own_secrets": status(lambda: v1.list_namespaced_secret(ns)),
            "other_pods": status(lambda: v1.list_namespaced_pod("kube-system")),
            "nodes": status(lambda: v1.list_node()),
        }), flush=True)
    """
    container = python_container("main", script) | {
        "env": [
            {
                "name": "POD_NAMESPACE",
                "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
            }
        ]
    }
    core.create_namespaced_pod(
        namespace,
        build(
            client.V1Pod.from_dict,
            pod_manifest(
                "rbaccheck", [container], restartPolicy="Never", serviceAccountName="reader"
            ),
        ),
    )
    pod = wait_for(
        "the RBAC probe pod to finish",
        lambda: pod_phase(core, namespace, "rbaccheck", "Succeeded", "Failed"),
        timeout=90,
    )
    logs = local_cluster.kubectl("logs", "-n", namespace, "rbaccheck").stdout
    assert pod["status"]["phase"] == "Succeeded", logs
    assert json.loads(logs.strip().splitlines()[-1]) == {
        "own_pods": 200,
        "own_secrets": 403,
        "other_pods": 403,
        "nodes": 403,
    }


def test_pod_violating_restricted_is_rejected(core: client.CoreV1Api, namespace: str) -> None:
    core.patch_namespace(
        namespace,
        {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted"}}},
    )
    privileged = python_container("main", "pass") | {"securityContext": {"privileged": True}}
    with pytest.raises(ApiException) as info:
        core.create_namespaced_pod(
            namespace, build(client.V1Pod.from_dict, pod_manifest("priv", [privileged]))
        )
    assert info.value.status == 403
    message = json.loads(str(info.value.body))["message"]
    assert 'violates PodSecurity "restricted:latest": privileged' in message

    # The same namespace admits a pod that meets the profile, so the rejection is the policy's.
    compliant = python_container("main", "pass") | {
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        }
    }
    created = core.create_namespaced_pod(
        namespace, build(client.V1Pod.from_dict, pod_manifest("fine", [compliant]))
    )
    assert created.to_dict(serialize=True)["metadata"]["uid"]


def test_deleting_owner_garbage_collects_owned_pods(
    local_cluster: LocalCluster, core: client.CoreV1Api, namespace: str
) -> None:
    apps = client.AppsV1Api(local_cluster.api)
    labels = {"app": "gc"}
    apps.create_namespaced_deployment(
        namespace,
        build(
            client.V1Deployment.from_dict,
            {
                "metadata": {"name": "gc"},
                "spec": {
                    "replicas": 2,
                    "selector": {"matchLabels": labels},
                    "template": {
                        "metadata": {"labels": labels},
                        "spec": {
                            "terminationGracePeriodSeconds": 5,
                            "containers": [
                                python_container("main", "import time; time.sleep(3600)")
                            ],
                        },
                    },
                },
            },
        ),
    )

    def pods() -> list[dict[str, Any]]:
        items = core.list_namespaced_pod(namespace, label_selector="app=gc")
        return list(items.to_dict(serialize=True)["items"])

    def running_pods() -> list[dict[str, Any]] | None:
        running = [p for p in pods() if p["status"].get("phase") == "Running"]
        return running if len(running) == 2 else None

    running = wait_for("the deployment's 2 pods to run", running_pods)
    uids = [p["metadata"]["uid"] for p in running]
    assert all(local_cluster.pod_processes(uid) for uid in uids)
    assert {p["metadata"]["ownerReferences"][0]["kind"] for p in running} == {"ReplicaSet"}

    apps.delete_namespaced_deployment("gc", namespace, propagation_policy="Background")
    wait_for(
        "the garbage collector to delete the ReplicaSet and its pods",
        lambda: not pods() and not apps.list_namespaced_replica_set(namespace).items,
    )
    assert all(not local_cluster.pod_processes(uid) for uid in uids)


def test_gang_of_pod_group_binds_no_pod_until_all_fit(
    local_cluster: LocalCluster, core: client.CoreV1Api, namespace: str
) -> None:
    """GenericWorkload gang scheduling: a PodGroup with minCount 2 whose second pod has no
    room gets neither pod bound (no pod holds its GPUs while its peer waits); once a second
    node fits, both bind together and run."""
    custom = client.CustomObjectsApi(local_cluster.api)
    custom.create_namespaced_custom_object(
        "scheduling.k8s.io", "v1beta1", namespace, "podgroups",
        {
            "apiVersion": "scheduling.k8s.io/v1beta1",
            "kind": "PodGroup",
            "metadata": {"name": "gang"},
            "spec": {"schedulingPolicy": {"gang": {"minCount": 2}}},
        },
    )  # fmt: skip
    # Two fresh nodes, so no other test's pods hold their GPUs; a pod takes a whole node's
    # GPUs and may only go where this test's label is, which only node_a has at first.
    node_a, node_b = local_cluster.add_node(), local_cluster.add_node()
    label = {"baton-test/gang": namespace}
    core.patch_node(node_a, {"metadata": {"labels": label}})
    gpus = {"nvidia.com/gpu": str(DEFAULT_CONFIG.gpus_per_node)}  # client 37's models want str
    names = ("gang-0", "gang-1")
    for name in names:
        manifest = pod_manifest(
            name,
            [{**python_container("main", "import time; time.sleep(3600)"),
              "resources": {"limits": gpus}}],
            nodeSelector=label,
            schedulingGroup={"podGroupName": "gang"},
        )  # fmt: skip
        core.create_namespaced_pod(namespace, build(client.V1Pod.from_dict, manifest))
    for name in names:
        pod = read_pod(core, namespace, name)
        assert pod is not None
        assert pod["spec"]["schedulingGroup"] == {"podGroupName": "gang"}

    def group_unschedulable() -> str | None:
        group = cast(
            dict[str, Any],
            custom.get_namespaced_custom_object(
                "scheduling.k8s.io", "v1beta1", namespace, "podgroups", "gang"
            ),
        )
        for c in (group.get("status") or {}).get("conditions") or []:
            if c["type"] == "PodGroupInitiallyScheduled" and c["reason"] == "Unschedulable":
                return str(c["message"])
        return None

    # The scheduler's verdict on the whole gang, not a guess at how long it needs.
    message = wait_for("the scheduler to find the gang unschedulable", group_unschedulable)
    assert "minCount (2) cannot be satisfied" in message
    for name in names:
        pod = read_pod(core, namespace, name)
        assert pod is not None
        assert pod["spec"].get("nodeName") is None, f"{name} was bound alone: {pod}"

    core.patch_node(node_b, {"metadata": {"labels": label}})

    def both_running() -> list[dict[str, Any]] | None:
        running = [p for n in names if (p := pod_phase(core, namespace, n, "Running"))]
        return running if len(running) == len(names) else None

    running = wait_for("both gang pods to bind and run once a second node fits", both_running)
    assert sorted(p["spec"]["nodeName"] for p in running) == sorted([node_a, node_b])


def run_pinned_sleeper(
    cluster: LocalCluster, core: client.CoreV1Api, ns: str, name: str, node: str
) -> dict[str, Any]:
    manifest = pod_manifest(
        name,
        [python_container("main", SLEEPER)],
        nodeSelector={"kubernetes.io/hostname": node},
        terminationGracePeriodSeconds=300,
    )
    core.create_namespaced_pod(ns, build(client.V1Pod.from_dict, manifest))
    pod = wait_for(f"{name} to run on {node}", lambda: pod_phase(core, ns, name, "Running"))
    # Only once the SIGTERM handler is installed does the pod stand for a stubborn job.
    wait_for(
        f"{name} to ignore SIGTERM",
        lambda: "armed" in cluster.kubectl("logs", "-n", ns, name, check=False).stdout,
    )
    return pod


def test_aws_preemption_taints_then_kills_the_node(
    local_cluster: LocalCluster, core: client.CoreV1Api, at_module_end: contextlib.ExitStack
) -> None:
    # A namespace of its own that outlives the test: deleting it would also ask to delete the
    # orphaned pod that pod GC is awaited to remove (below), so it goes only after that check.
    namespace = new_namespace(core)
    at_module_end.callback(core.delete_namespace, namespace)
    node = local_cluster.add_node(spot=True)
    pod = run_pinned_sleeper(local_cluster, core, namespace, "victim", node)
    uid = pod["metadata"]["uid"]
    assert pod["spec"]["nodeName"] == node
    assert local_cluster.pod_processes(uid)

    grace = 6
    local_cluster.preempt(node, provider="aws", grace_s=grace)
    noticed = time.monotonic()
    n = read_node(core, node)
    taints = {t["key"]: t for t in n["spec"]["taints"]}
    itn = taints["aws-node-termination-handler/spot-itn"]
    assert itn["effect"] == "NoSchedule"
    assert itn["value"].startswith("spot-itn-")
    assert n["metadata"]["labels"]["aws-node-termination-handler/event-id"] == itn["value"]
    assert n["spec"]["unschedulable"] is True  # NTH cordons

    # NTH drains: the pod is evicted (graceful deletion) but ignores SIGTERM, so it lives on
    # until the machine dies at the end of the notice.
    wait_for(
        "NTH's drain to evict the pod",
        lambda: (
            (p := read_pod(core, namespace, "victim")) and p["metadata"].get("deletionTimestamp")
        ),
    )
    assert local_cluster.pod_processes(uid)
    wait_for(
        "the pod's processes to be killed with the machine",
        lambda: not local_cluster.pod_processes(uid),
        timeout=grace + 10,
    )
    assert time.monotonic() - noticed >= grace - 1
    wait_for("the Node object to be removed", lambda: node not in node_names(core), timeout=15)
    # As in a cloud: nobody reports for the pod any more, and pod GC deletes the orphan
    # (after its 40 s quarantine for nodes that might come back): awaited after the module's
    # last test (at_module_end), with a bound that allows for the API server restart test.
    removed = time.monotonic()
    assert read_pod(core, namespace, "victim"), "the pod went before its quarantine could end"
    at_module_end.callback(
        lambda: wait_for(
            f"pod GC to delete the pod orphaned by the removed node {node} "
            "(test_aws_preemption_taints_then_kills_the_node)",
            lambda: not read_pod(core, namespace, "victim"),
            timeout=max(0.0, removed + 240 - time.monotonic()),
        )
    )


def test_kill_node_leads_to_not_ready_and_eviction(
    local_cluster: LocalCluster, core: client.CoreV1Api, namespace: str
) -> None:
    node = local_cluster.add_node()
    pod = run_pinned_sleeper(local_cluster, core, namespace, "stranded", node)
    uid = pod["metadata"]["uid"]
    local_cluster.kill_node(node)
    wait_for(
        "the node's processes to die with it",
        lambda: not local_cluster.pod_processes(uid),
        timeout=10,
    )
    # node-lifecycle notices the silent Lease, marks the node NotReady (Unknown) and taints it.
    wait_for(
        "the node-lifecycle controller to mark the node not ready",
        lambda: (x := read_node(core, node)) and node_ready(x) == "Unknown" and x,
        timeout=60,
    )
    wait_for(
        "the unreachable NoExecute taint",
        lambda: (
            (x := read_node(core, node))
            and any(
                t["key"] == "node.kubernetes.io/unreachable" and t["effect"] == "NoExecute"
                for t in x["spec"].get("taints") or []
            )
            and x
        ),
        timeout=30,
    )
    # taint-eviction evicts the pod once its default toleration for unreachable runs out.
    evicted = wait_for(
        "taint-eviction to evict the pod",
        lambda: (
            (p := read_pod(core, namespace, "stranded"))
            and p["metadata"].get("deletionTimestamp")
            and p
        ),
        timeout=60,
    )
    disruption = [c for c in evicted["status"]["conditions"] if c["type"] == "DisruptionTarget"]
    assert disruption
    assert disruption[0]["reason"] == "DeletionByTaintManager"
    assert node in node_names(core)  # the Node stays: no cloud removed it


def _process_state(pid: int) -> str:
    """The state letter of /proc/<pid>/stat: R, S, T (stopped), ..."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


def _lease(local_cluster: LocalCluster, node: str) -> dict[str, Any]:
    lease = client.CoordinationV1Api(local_cluster.api).read_namespaced_lease(
        node, "kube-node-lease"
    )
    return cast(dict[str, Any], lease.to_dict(serialize=True)["spec"])


def _sleeper_on_a_new_node(
    local_cluster: LocalCluster, core: client.CoreV1Api, namespace: str, name: str
) -> tuple[str, str, list[int]]:
    """A sleeper pod on a node of its own: (node, pod UID, the pod's process IDs)."""
    node = local_cluster.add_node()
    pod = run_pinned_sleeper(local_cluster, core, namespace, name, node)
    uid = pod["metadata"]["uid"]
    pids = local_cluster.pod_processes(uid)
    assert pids
    return node, uid, pids


def _all_stopped(pids: list[int]) -> None:
    wait_for(
        "every process of the pod to be stopped",
        lambda: all(_process_state(p) == "T" for p in pids),
        timeout=5,
    )


def test_freeze_node_stops_the_lease_and_the_processes_then_brings_both_back(
    local_cluster: LocalCluster, core: client.CoreV1Api, namespace: str
) -> None:
    node, uid, pids = _sleeper_on_a_new_node(local_cluster, core, namespace, "blip")
    before = _lease(local_cluster, node)
    # A kubelet renews every quarter of the Lease's duration; the agents every 2 s.
    assert before["leaseDurationSeconds"] == 8
    local_cluster.freeze_node(node, 6)
    _all_stopped(pids)
    frozen = _lease(local_cluster, node)["renewTime"]
    time.sleep(3)  # more than one renew interval: a renewing agent would have written again
    assert _lease(local_cluster, node)["renewTime"] == frozen, "renewed while frozen"
    assert all(_process_state(p) == "T" for p in pids)
    with pytest.raises(LocalClusterError, match="frozen already"):
        local_cluster.freeze_node(node, 1)
    wait_for(
        "the Lease to be renewed after the thaw",
        lambda: _lease(local_cluster, node)["renewTime"] != frozen,
        timeout=15,
    )
    wait_for(
        "the pod's processes to run again",
        lambda: all(_process_state(p) in "RS" for p in pids),
        timeout=5,
    )
    after = read_pod(core, namespace, "blip")
    assert after is not None
    assert after["status"]["phase"] == "Running"
    assert after["status"]["containerStatuses"][0]["restartCount"] == 0
    assert local_cluster.pod_processes(uid) == pids, "nothing was killed or restarted"
    # 6 s without a renewal can exceed the 8 s node-monitor grace (the last renewal was up to
    # 2 s before): the node may have been Unknown for a moment; the thaw's status makes it
    # Ready again.
    wait_for(
        "the node to be Ready again",
        lambda: node_ready(read_node(core, node)) == "True",
        timeout=15,
    )
    with pytest.raises(LocalClusterError, match="no live node"):
        local_cluster.freeze_node("no-such-node", 1)
    core.delete_namespaced_pod("blip", namespace, grace_period_seconds=0)


def test_node_killed_while_frozen_stays_dead(
    local_cluster: LocalCluster, core: client.CoreV1Api, namespace: str
) -> None:
    node, uid, pids = _sleeper_on_a_new_node(local_cluster, core, namespace, "frozen-then-killed")
    # freeze-node returns with the processes stopped and no renewal in flight.
    local_cluster.freeze_node(node, 3)
    frozen = _lease(local_cluster, node)["renewTime"]
    _all_stopped(pids)
    local_cluster.kill_node(node)
    wait_for(
        "SIGKILL to end the stopped processes",
        lambda: not local_cluster.pod_processes(uid),
        timeout=10,
    )
    time.sleep(5)  # past the thaw that was due: it must not bring the heartbeat back
    assert _lease(local_cluster, node)["renewTime"] == frozen, "a dead node renewed its Lease"
    assert node not in local_cluster.nodes()
    with pytest.raises(LocalClusterError, match="no live node"):
        local_cluster.freeze_node(node, 1)


def test_init_container_native_sidecar_and_on_failure_restart(
    local_cluster: LocalCluster, core: client.CoreV1Api, namespace: str
) -> None:
    # The init container writes through the volume's host directory (processes cannot see
    # mounts); the main container fails once, is restarted (OnFailure), then succeeds; the
    # sidecar serves HTTP on the pod IP, is ready through an httpGet probe, and is stopped
    # after the main container.
    shared = [{"name": "shared", "mountPath": "/shared"}]
    # Pods share the host's ports: a process elsewhere listening on 0.0.0.0:<port> blocks the
    # pod IP's <port> too, so take one that is free now.
    with socket.socket() as probe:
        probe.bind(("0.0.0.0", 0))
        port = probe.getsockname()[1]
    init = python_container(
        "init", "import os; open(os.environ['LOCALCLUSTER_VOLUME_SHARED'] + '/init', 'w')"
    ) | {"volumeMounts": shared}
    sidecar = python_container(
        "sidecar",
        """
        import http.server, os
        addr = (os.environ["POD_IP"], int(os.environ["PORT"]))
        http.server.HTTPServer(addr, http.server.SimpleHTTPRequestHandler).serve_forever()
        """,
    ) | {
        "restartPolicy": "Always",
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "PORT", "value": str(port)},
        ],
        "readinessProbe": {"httpGet": {"path": "/", "port": port}, "periodSeconds": 1},
    }
    main = python_container(
        "main",
        """
        import os, sys, time
        d = sys.argv[1]
        assert os.path.exists(d + "/init")
        runs = 1 + sum(name.startswith("run") for name in os.listdir(d))
        open(f"{d}/run{runs}", "w")
        print("run", runs, flush=True)
        if runs == 1:
            sys.exit(1)
        # Stay up until the test has seen the pod Ready: it then writes "release" here.
        deadline = time.monotonic() + 120
        while not os.path.exists(d + "/release") and time.monotonic() < deadline:
            time.sleep(0.1)
        """,
    ) | {"args": ["/shared"], "volumeMounts": shared}
    manifest = pod_manifest(
        "sidecar",
        [main],
        initContainers=[init, sidecar],
        restartPolicy="OnFailure",
        volumes=[{"name": "shared", "emptyDir": {}}],
    )
    core.create_namespaced_pod(namespace, build(client.V1Pod.from_dict, manifest))

    def all_ready() -> dict[str, Any] | None:
        # Ready with the main container's second run (the first one may look Ready for the
        # moment it runs before it fails).
        pod = pod_phase(core, namespace, "sidecar", "Running")
        ready = pod and {c["type"]: c["status"] for c in pod["status"]["conditions"]}
        main = (pod or {}).get("status", {}).get("containerStatuses") or [{}]
        second = main[0].get("restartCount") == 1 and (main[0].get("state") or {}).get("running")
        return pod if ready and ready["Ready"] == "True" and second else None

    ready = wait_for("the pod to be Ready with its sidecar", all_ready, timeout=90)
    # Ready seen: let the main container finish (a fixed sleep there raced a loaded machine).
    meta = ready["metadata"]
    volume = local_cluster.directory / "pods" / f"{namespace}_sidecar_{meta['uid']}" / "volumes"
    (volume / "shared" / "release").touch()

    def finished() -> dict[str, Any] | None:
        # The pod turns terminal when its main container is done, and only then are its
        # sidecars stopped (as the kubelet does): their end comes in a later status update.
        pod = pod_phase(core, namespace, "sidecar", "Succeeded", "Failed")
        statuses = (pod or {}).get("status", {}).get("initContainerStatuses") or []
        stopped = all((s.get("state") or {}).get("terminated") for s in statuses)
        return pod if pod and statuses and stopped else None

    pod = wait_for("the pod to succeed and its sidecar to stop", finished)
    status = pod["status"]
    assert status["phase"] == "Succeeded"
    main_status = status["containerStatuses"][0]
    assert main_status["restartCount"] == 1
    assert main_status["lastState"]["terminated"]["exitCode"] == 1
    assert main_status["state"]["terminated"]["exitCode"] == 0
    init_status, sidecar_status = status["initContainerStatuses"]
    assert init_status["state"]["terminated"]["exitCode"] == 0
    sidecar_end = sidecar_status["state"]["terminated"]
    assert sidecar_end["signal"] == 15  # stopped with SIGTERM once main was done
    assert sidecar_end["finishedAt"] >= main_status["state"]["terminated"]["finishedAt"]
    previous = local_cluster.kubectl("logs", "-n", namespace, "sidecar", "-c", "main", "--previous")
    assert previous.stdout.strip() == "run 1"
    assert local_cluster.kubectl(
        "logs", "-n", namespace, "sidecar", "-c", "main"
    ).stdout.strip() == ("run 2")


def test_gke_preemption_shuts_pods_down_on_the_node(
    local_cluster: LocalCluster, core: client.CoreV1Api, namespace: str
) -> None:
    node = local_cluster.add_node(spot=True)
    graceful = python_container(
        "main",
        """
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        print("armed", flush=True)
        while True:
            time.sleep(1)
        """,
    )
    manifest = pod_manifest("gke", [graceful], nodeSelector={"kubernetes.io/hostname": node})
    core.create_namespaced_pod(namespace, build(client.V1Pod.from_dict, manifest))
    wait_for(
        "the pod to run",
        lambda: (
            pod_phase(core, namespace, "gke", "Running")
            and "armed" in local_cluster.kubectl("logs", "-n", namespace, "gke", check=False).stdout
        ),
    )
    local_cluster.preempt(node, provider="gke", grace_s=4)
    taints = read_node(core, node)["spec"]["taints"]
    assert {"key": "cloud.google.com/impending-node-termination", "effect": "NoSchedule"} in [
        {"key": t["key"], "effect": t["effect"]} for t in taints
    ]
    # The kubelet's graceful node shutdown: SIGTERM, then the pod ends Failed, marked as a
    # disruption, and stays in the API until the node is gone.
    pod = wait_for("the pod to be shut down", lambda: pod_phase(core, namespace, "gke", "Failed"))
    assert pod["status"]["reason"] == "Terminated"
    disruption = [c for c in pod["status"]["conditions"] if c["type"] == "DisruptionTarget"]
    assert disruption[0]["reason"] == "TerminationByKubelet"
    assert pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
    wait_for("the Node object to be removed", lambda: node not in node_names(core), timeout=15)


GRACEFUL = """
    import signal, sys, time
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("armed", flush=True)
    while True:
        time.sleep(1)
"""


def _refuses_connections(local_cluster: LocalCluster) -> bool:
    server = json.loads((local_cluster.directory / "cluster.json").read_text())["server"]
    host, port = server.removeprefix("https://").rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def test_apiserver_restart_keeps_state_and_running_pods(
    local_cluster: LocalCluster, core: client.CoreV1Api, namespace: str
) -> None:
    # A real kube-apiserver restart: while it is down its port refuses connections and open
    # watches end; etcd keeps every object; the node agents keep the pods running and the
    # controllers, scheduler and agents pick up again once it is back.
    core.create_namespaced_config_map(
        namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="kept"), data={"k": "v"})
    )
    before = core.read_namespaced_config_map("kept", namespace).metadata.resource_version
    manifest = pod_manifest("survivor", [python_container("main", GRACEFUL)])
    core.create_namespaced_pod(namespace, build(client.V1Pod.from_dict, manifest))
    running = wait_for("the pod to run", lambda: pod_phase(core, namespace, "survivor", "Running"))
    uid = running["metadata"]["uid"]
    pids = local_cluster.pod_processes(uid)
    assert pids
    ready_nodes = [
        n["metadata"]["name"]
        for n in core.list_node().to_dict(serialize=True)["items"]
        if node_ready(n) == "True"
    ]

    ended = threading.Event()
    cut: list[Exception] = []

    def watch() -> None:
        # A watch that would run for 5 minutes: the API server's shutdown ends it, cleanly or
        # with the stream cut off mid-chunk (both are how a client sees a restart).
        try:
            for _ in k8s_watch.Watch().stream(
                core.list_namespaced_config_map, namespace, timeout_seconds=300
            ):
                pass
        except (urllib3.exceptions.HTTPError, OSError) as e:
            cut.append(e)
        finally:
            ended.set()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with local_cluster.apiserver_down():
        assert _refuses_connections(local_cluster)
        assert ended.wait(timeout=60), "the open watch did not end when the API server stopped"
        print(f"the watch ended {'with ' + repr(cut[0]) if cut else 'cleanly'}")
        # Longer than the 8 s node-monitor grace: the node-lifecycle controller cannot act on
        # it (it cannot write), and the nodes' pods run on.
        time.sleep(10)
        assert local_cluster.pod_processes(uid) == pids
    after = core.read_namespaced_config_map("kept", namespace)
    assert after.data == {"k": "v"}
    assert after.metadata.resource_version == before  # the same object, from etcd

    def all_ready() -> bool:
        nodes = {
            n["metadata"]["name"]: n for n in core.list_node().to_dict(serialize=True)["items"]
        }
        return all(name in nodes and node_ready(nodes[name]) == "True" for name in ready_nodes)

    wait_for("the nodes to be Ready again", all_ready, timeout=120)
    # The scheduler and the node agents watch again: a new pod is scheduled, runs and ends.
    done = pod_manifest("after", [python_container("main", "print('ran')")], restartPolicy="Never")
    core.create_namespaced_pod(namespace, build(client.V1Pod.from_dict, done))
    ran = wait_for(
        "a pod created after the restart to succeed",
        lambda: pod_phase(core, namespace, "after", "Succeeded", "Failed"),
        timeout=120,
    )
    assert ran["status"]["phase"] == "Succeeded"
    pod = read_pod(core, namespace, "survivor")
    assert pod is not None
    assert pod["metadata"]["uid"] == uid
    assert not pod["metadata"].get("deletionTimestamp"), "the outage got the pod evicted"
    assert pod["status"]["phase"] == "Running"
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0
    assert local_cluster.pod_processes(uid) == pids


VOLUME_MODES = """
    import json, os, stat
    out = {}
    for vol in ("SECRET", "CONFIG"):
        root = os.environ["LOCALCLUSTER_VOLUME_" + vol]
        for name in sorted(os.listdir(root)):
            st = os.stat(os.path.join(root, name))
            out[vol.lower() + "/" + name] = [oct(stat.S_IMODE(st.st_mode)), st.st_gid]
    print(json.dumps(out), flush=True)
"""


def _volume_modes(
    local_cluster: LocalCluster, core: client.CoreV1Api, ns: str, name: str, **spec: Any
) -> dict[str, list[Any]]:
    mounts = [{"name": "secret", "mountPath": "/s"}, {"name": "config", "mountPath": "/c"}]
    volumes = [
        {
            "name": "secret",
            "secret": {
                "secretName": "modes",
                "defaultMode": 0o440,
                "items": [{"key": "a", "path": "a"}, {"key": "b", "path": "b", "mode": 0o600}],
            },
        },
        {"name": "config", "configMap": {"name": "modes"}},
    ]
    container = python_container("main", VOLUME_MODES) | {"volumeMounts": mounts}
    manifest = pod_manifest(name, [container], restartPolicy="Never", volumes=volumes, **spec)
    core.create_namespaced_pod(ns, build(client.V1Pod.from_dict, manifest))
    pod = wait_for(f"{name} to finish", lambda: pod_phase(core, ns, name, "Succeeded", "Failed"))
    logs = local_cluster.kubectl("logs", "-n", ns, name).stdout
    assert pod["status"]["phase"] == "Succeeded", logs
    seen: dict[str, list[Any]] = json.loads(logs.strip().splitlines()[-1])
    return seen


def test_volume_file_modes_and_fs_group_as_the_kubelet_writes_them(
    local_cluster: LocalCluster, core: client.CoreV1Api, namespace: str
) -> None:
    core.create_namespaced_secret(
        namespace,
        client.V1Secret(
            metadata=client.V1ObjectMeta(name="modes"), string_data={"a": "1", "b": "2"}
        ),
    )
    core.create_namespaced_config_map(
        namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="modes"), data={"c": "3"})
    )
    own_gid = os.getegid()
    # Without fsGroup: defaultMode and items[].mode exactly (past the umask), the agent's group.
    plain = _volume_modes(local_cluster, core, namespace, "plain")
    assert plain == {
        "secret/a": ["0o440", own_gid],
        "secret/b": ["0o600", own_gid],
        "config/c": ["0o644", own_gid],
    }
    # With fsGroup: the group is the fsGroup, and read-only volumes gain group read (the
    # kubelet's SetVolumeOwnership). Only root can give a file a group it is not in.
    grouped = _volume_modes(
        local_cluster, core, namespace, "grouped", securityContext={"fsGroup": 2345}
    )
    gid = 2345 if os.geteuid() == 0 else own_gid
    assert grouped == {
        "secret/a": ["0o440", gid],
        "secret/b": ["0o640", gid],
        "config/c": ["0o644", gid],
    }


# --- cluster DNS (dns.go, podnet.go) -------------------------------------------------------


def dns_query(
    server: str, name: str, *, qtype: int = 1, tcp: bool = False
) -> tuple[int, list[str]]:
    """One DNS query to ``server`` port 53: (rcode, the A records' addresses)."""
    qid = int.from_bytes(os.urandom(2), "big")
    labels = b"".join(bytes([len(p)]) + p.encode() for p in name.rstrip(".").split("."))
    query = qid.to_bytes(2, "big") + b"\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00"
    query += labels + b"\x00" + qtype.to_bytes(2, "big") + b"\x00\x01"
    if tcp:
        with socket.create_connection((server, 53), timeout=10) as s:
            s.sendall(len(query).to_bytes(2, "big") + query)
            size = int.from_bytes(_recv_exactly(s, 2), "big")
            resp = _recv_exactly(s, size)
    else:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(10)
            s.sendto(query, (server, 53))
            resp = s.recv(65535)
    assert resp[:2] == query[:2], "the answer carries the query's id"
    rcode, ancount = resp[3] & 0x0F, int.from_bytes(resp[6:8], "big")
    pos = len(query)  # the server echoes the one question as sent
    addrs = []
    for _ in range(ancount):
        if resp[pos] & 0xC0 == 0xC0:  # a compression pointer
            pos += 2
        else:
            while resp[pos]:
                pos += resp[pos] + 1
            pos += 1
        rtype, rdlen = (
            int.from_bytes(resp[pos : pos + 2], "big"),
            int.from_bytes(resp[pos + 8 : pos + 10], "big"),
        )
        if rtype == 1:
            addrs.append(socket.inet_ntoa(resp[pos + 10 : pos + 14]))
        pos += 10 + rdlen
    return rcode, sorted(addrs)


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        assert chunk, "the DNS server closed the TCP connection mid-answer"
        data += chunk
    return data


NOERROR, NXDOMAIN = 0, 3


def _dns_ip(local_cluster: LocalCluster) -> str:
    info = json.loads((local_cluster.directory / "cluster.json").read_text())
    return str(info["dnsIP"])


def _headless_service(name: str, selector: dict[str, str], *, publish: bool) -> client.V1Service:
    spec = {"clusterIP": "None", "selector": selector, "publishNotReadyAddresses": publish}
    return build(client.V1Service.from_dict, {"metadata": {"name": name}, "spec": spec})


POD_IP_ENV = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}

DNS_SERVER = """
    import os, socket
    srv = socket.create_server((os.environ["POD_IP"], 7070))
    print("serving", flush=True)
    while True:
        conn, _ = srv.accept()
        conn.sendall(socket.gethostname().encode())
        conn.close()
"""

DNS_CLIENT = """
    import json, os, socket, time
    ns = os.environ["NS"]
    deadline = time.monotonic() + 60
    while True:  # the server pod may not have its IP yet
        try:
            short = socket.gethostbyname("h0.grp")
            break
        except socket.gaierror:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    fqdn = socket.gethostbyname(f"h0.grp.{ns}.svc.cluster.local")
    while True:  # it may not listen yet
        try:
            with socket.create_connection(("h0.grp", 7070), timeout=10) as c:
                served = c.recv(100).decode()
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    print(json.dumps({
        "hostname": socket.gethostname(), "short": short, "fqdn": fqdn, "served": served,
        "own": socket.gethostbyname(socket.gethostname()), "own_fqdn": socket.getfqdn(),
        "service": sorted({a[4][0] for a in socket.getaddrinfo("grp", 0, socket.AF_INET)}),
        "localhost": socket.gethostbyname("localhost"),
        "resolv": open("/etc/resolv.conf").read(), "env_hostname": os.environ["HOSTNAME"],
    }), flush=True)
"""


def test_cluster_dns_resolves_pods_by_hostname_and_subdomain(
    local_cluster: LocalCluster, core: client.CoreV1Api, namespace: str
) -> None:
    """Pods with hostname + subdomain under a headless Service reach each other by name, as
    ranks of a gang rendezvous on rank 0's DNS name before anyone knows its IP."""
    core.create_namespaced_service(
        namespace, _headless_service("grp", {"dns": "grp"}, publish=True)
    )
    for name, host, script, env in [
        ("server", "h0", DNS_SERVER, [POD_IP_ENV]),
        ("client", "h1", DNS_CLIENT, [{"name": "NS", "value": namespace}]),
    ]:
        manifest = pod_manifest(
            name,
            [python_container("main", script) | {"env": env}],
            hostname=host,
            subdomain="grp",
            restartPolicy="Never",
        )
        manifest["metadata"]["labels"]["dns"] = "grp"
        core.create_namespaced_pod(namespace, build(client.V1Pod.from_dict, manifest))
    done = wait_for(
        "the client pod to finish",
        lambda: pod_phase(core, namespace, "client", "Succeeded", "Failed"),
        120,
    )
    logs = local_cluster.kubectl("logs", "-n", namespace, "client").stdout
    assert done["status"]["phase"] == "Succeeded", logs
    seen = json.loads(logs.strip().splitlines()[-1])
    server_ip = wait_for(
        "the server's pod IP",
        lambda: (read_pod(core, namespace, "server") or {}).get("status", {}).get("podIP"),
    )
    client_ip = done["status"]["podIP"]
    assert seen["short"] == seen["fqdn"] == server_ip  # the search path completes h0.grp
    assert seen["served"] == "h0"  # connected to the server pod, whose hostname is h0
    assert seen["hostname"] == seen["env_hostname"] == "h1"
    # The pod's own hostname resolves to its pod IP (/etc/hosts), as gloo looks it up.
    assert seen["own"] == client_ip
    assert seen["own_fqdn"] == f"h1.grp.{namespace}.svc.cluster.local"
    assert seen["service"] == sorted([server_ip, client_ip])
    assert seen["localhost"] == "127.0.0.1"
    assert seen["resolv"].splitlines()[1:] == [
        f"nameserver {_dns_ip(local_cluster)}",
        f"search {namespace}.svc.cluster.local svc.cluster.local cluster.local",
        "options ndots:5",
    ]


def test_cluster_dns_publishes_not_ready_pods_only_when_the_service_says_so(
    local_cluster: LocalCluster, core: client.CoreV1Api, namespace: str, tmp_path: Any
) -> None:
    dns = _dns_ip(local_cluster)
    ready_file = tmp_path / "ready"
    for svc, publish in [("pub", True), ("nopub", False)]:
        core.create_namespaced_service(
            namespace, _headless_service(svc, {"dns": svc}, publish=publish)
        )
        manifest = pod_manifest(
            svc,
            [
                python_container("main", "import time; time.sleep(3600)")
                | {
                    "readinessProbe": {
                        "exec": {"command": ["test", "-e", str(ready_file)]},
                        "periodSeconds": 1,
                    }
                }
            ],
            hostname="h",
            subdomain=svc,
        )
        manifest["metadata"]["labels"]["dns"] = svc
        core.create_namespaced_pod(namespace, build(client.V1Pod.from_dict, manifest))
    ips = {
        svc: wait_for(
            f"{svc}'s pod IP",
            lambda svc=svc: (read_pod(core, namespace, svc) or {}).get("status", {}).get("podIP"),
        )
        for svc in ("pub", "nopub")
    }
    # Not Ready yet: the publishing Service names its pod, the other does not.
    pub_host = f"h.pub.{namespace}.svc.cluster.local"
    assert wait_for("the not-ready pod's name", lambda: dns_query(dns, pub_host)[1]) == [ips["pub"]]
    assert dns_query(dns, f"pub.{namespace}.svc.cluster.local") == (NOERROR, [ips["pub"]])
    assert dns_query(dns, pub_host, tcp=True) == (NOERROR, [ips["pub"]])
    assert dns_query(dns, pub_host, qtype=28) == (NOERROR, [])  # AAAA: the name exists, no IPv6
    pod = read_pod(core, namespace, "nopub")
    assert pod
    assert not any(
        c["type"] == "Ready" and c["status"] == "True" for c in pod["status"]["conditions"]
    )
    assert dns_query(dns, f"h.nopub.{namespace}.svc.cluster.local") == (NXDOMAIN, [])
    assert dns_query(dns, f"nopub.{namespace}.svc.cluster.local") == (NOERROR, [])
    assert dns_query(dns, f"absent.{namespace}.svc.cluster.local") == (NXDOMAIN, [])
    # Once Ready, it is named too.
    ready_file.write_text("")
    wait_for(
        "the ready pod's name",
        lambda: dns_query(dns, f"h.nopub.{namespace}.svc.cluster.local")[1] == [ips["nopub"]],
    )
    assert dns_query(dns, f"nopub.{namespace}.svc.cluster.local") == (NOERROR, [ips["nopub"]])


def test_cluster_dns_forwards_other_names_and_honours_dns_policy(
    local_cluster: LocalCluster, core: client.CoreV1Api, namespace: str
) -> None:
    dns = _dns_ip(local_cluster)
    # A name outside the cluster domain gets the host's nameserver's verdict.
    with open("/etc/resolv.conf") as f:
        host_ns = next(line.split()[1] for line in f if line.startswith("nameserver"))
    try:
        rcode, addrs = dns_query(host_ns, "example.com")
    except OSError:
        rcode, addrs = 2, []  # the host's nameserver does not answer: the cluster DNS SERVFAILs
    # (A slow upstream answer makes the cluster DNS say SERVFAIL after 2 s; ask again then, as
    # a resolver would.)
    for _ in range(3):
        forwarded = dns_query(dns, "example.com")
        if forwarded[0] != 2 or rcode == 2:
            break
    assert forwarded[0] == rcode
    assert bool(forwarded[1]) == bool(addrs)

    show = """
        import json, socket
        print(json.dumps({
            "resolv": open("/etc/resolv.conf").read(), "hosts": open("/etc/hosts").read(),
            "alias": socket.gethostbyname("db.example"),
        }), flush=True)
    """
    aliases = [{"ip": "127.0.0.9", "hostnames": ["db.example", "db"]}]
    dns_config = {
        "nameservers": ["127.0.0.8"],
        "searches": ["corp.example"],
        "options": [{"name": "ndots", "value": "2"}],
    }
    specs = {
        "default": {"dnsPolicy": "Default"},
        "none": {"dnsPolicy": "None", "dnsConfig": dns_config},
    }
    for name, spec in specs.items():
        manifest = pod_manifest(
            name,
            [python_container("main", show)],
            restartPolicy="Never",
            hostAliases=aliases,
            **spec,
        )
        core.create_namespaced_pod(namespace, build(client.V1Pod.from_dict, manifest))
    seen = {}
    for name in specs:
        pod = wait_for(
            f"{name} to finish",
            lambda name=name: pod_phase(core, namespace, name, "Succeeded", "Failed"),
        )
        logs = local_cluster.kubectl("logs", "-n", namespace, name).stdout
        assert pod["status"]["phase"] == "Succeeded", logs
        seen[name] = json.loads(logs.strip().splitlines()[-1])
        assert seen[name]["alias"] == "127.0.0.9"
        assert "127.0.0.9\tdb.example\tdb" in seen[name]["hosts"].splitlines()
        assert f"{pod['status']['podIP']}\t{name}" in seen[name]["hosts"].splitlines()
    with open("/etc/resolv.conf") as f:
        assert seen["default"]["resolv"] == f.read()
    assert seen["none"]["resolv"].splitlines()[1:] == [
        "nameserver 127.0.0.8",
        "search corp.example",
        "options ndots:2",
    ]
