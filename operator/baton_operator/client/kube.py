"""The thin Kubernetes API layer: the only code in the operator that calls the API server.

Each method declares the RBAC permission it uses with :func:`_needs`; ``rbac.py`` builds the
ClusterRole from that registry, so a new call cannot ship without its verb and a removed call
takes its verb with it. The ``kubernetes`` client is synchronous, so every call runs in a
worker thread to keep kopf's event loop free.

Creates are idempotent (``409 AlreadyExists`` means "someone, maybe our previous life, already
made it"), and patches are retried on ``409 Conflict``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final, ParamSpec, TypeVar, cast

from kubernetes import client as k8s_client
from kubernetes import config as _k8s_config
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError as Urllib3Error

from baton_operator.pure import crd
from baton_operator.pure.errors import KubeError
from baton_operator.pure.nodes import NodeLease

__all__ = [
    "NODE_LEASE_NAMESPACE", "NODE_LEASE_PERMISSIONS", "PERMISSIONS", "Kube", "Permission",
    "describe", "load_client", "load_configuration",
]  # fmt: skip

_P = ParamSpec("_P")
_R = TypeVar("_R")

_CONFLICT_RETRIES: Final = 5

API_THREADS: Final = 16
"""Worker threads for the API calls, and connections kept to the API server. The client is
synchronous, so each call holds a thread for its round trip. Not asyncio's default executor:
that has min(32, cores + 4) threads (6 on 2 cores) shared with the rest of the process, so when
a node's notice concerns many jobs at once, their status writes queued there behind each other
and behind unrelated work; 16 lets that many jobs' writes be in flight together."""

# The client's generated stubs are partial (untyped config loaders, models where we ask for raw
# JSON with _preload_content=False); the raw-dict boundary is typed by our own signatures.
k8s_config: Any = _k8s_config


@dataclass(frozen=True, order=True)
class Permission:
    """One RBAC (group, resource, verb) triple."""

    group: str
    resource: str
    verb: str


PERMISSIONS: set[Permission] = set()
"""Every permission a :class:`Kube` method uses, filled in by :func:`_needs` at import."""


NODE_LEASE_NAMESPACE: Final = "kube-node-lease"
"""Where each kubelet renews its node's Lease (named after the node)."""
NODE_LEASE_PERMISSIONS: Final = frozenset({Permission("coordination.k8s.io", "leases", "get")})
"""What :meth:`Kube.node_lease_renewed` uses, in :data:`NODE_LEASE_NAMESPACE` only: kept out of
:data:`PERMISSIONS` because rbac.py grants it by a Role of its own there (the same triple in
the operator's namespace is its election Lease, granted by name)."""


def _needs(
    group: str, resource: str, *verbs: str
) -> Callable[[Callable[_P, Coroutine[Any, Any, _R]]], Callable[_P, Coroutine[Any, Any, _R]]]:
    def register(
        fn: Callable[_P, Coroutine[Any, Any, _R]],
    ) -> Callable[_P, Coroutine[Any, Any, _R]]:
        perms = frozenset(Permission(group, resource, v) for v in verbs)
        PERMISSIONS.update(perms)
        fn.__dict__.setdefault("baton_permissions", set()).update(perms)
        return fn

    return register


def _needs_node_lease(
    fn: Callable[_P, Coroutine[Any, Any, _R]],
) -> Callable[_P, Coroutine[Any, Any, _R]]:
    """:func:`_needs` for :data:`NODE_LEASE_PERMISSIONS`: declared on the method, not added
    to :data:`PERMISSIONS` (rbac.py grants it in ``kube-node-lease`` only)."""
    fn.__dict__.setdefault("baton_permissions", set()).update(NODE_LEASE_PERMISSIONS)
    return fn


def load_client(kubeconfig: str | None = None) -> Any:
    """Return a ``kubernetes`` ApiClient from the in-cluster account or a kubeconfig."""
    return k8s_client.ApiClient(load_configuration(kubeconfig))


def load_configuration(kubeconfig: str | None = None) -> Any:
    """A ``kubernetes`` Configuration: in-cluster when no kubeconfig is given and the pod has
    a ServiceAccount, else the given kubeconfig (or ``$KUBECONFIG``), read now, not at import."""
    configuration = k8s_client.Configuration()
    try:
        if kubeconfig is None:
            k8s_config.load_incluster_config(client_configuration=configuration)
        else:
            raise k8s_config.ConfigException("a kubeconfig was given")
    except k8s_config.ConfigException:
        path = kubeconfig or os.environ.get("KUBECONFIG") or None
        k8s_config.load_kube_config(config_file=path, client_configuration=configuration)
    # One kept connection per worker thread (urllib3's default is cores x 5, 10 on 2 cores):
    # a call beyond the pool's size opens and drops a connection of its own.
    configuration.connection_pool_maxsize = API_THREADS
    return configuration


def _status_body(e: ApiException) -> dict[str, Any]:
    try:
        body = json.loads(e.body or "{}")
    except (ValueError, TypeError):
        return {}
    return body if isinstance(body, dict) else {}


def _translate(e: ApiException, what: str) -> KubeError:
    # Only the reason and message from the API server: never headers, which carry the token.
    body = _status_body(e)
    reason = str(body.get("message") or e.reason or "")
    causes = (body.get("details") or {}).get("causes") or []
    # "<nil>": a cause of no field (a CRD's "some validation rules were not checked" note).
    fields = tuple(
        str(c["field"])
        for c in causes
        if isinstance(c, dict) and c.get("field") and c.get("field") != "<nil>"
    )
    return KubeError.from_answer(
        f"{what}: HTTP {e.status}: {reason}", status=int(e.status or 0), fields=fields
    )


def describe(e: BaseException) -> str:
    """An error from an API call, in words fit for a log: the HTTP status and the API server's
    reason and message (an RBAC refusal names the verb, the resource and the ServiceAccount).

    Understands this layer's :class:`KubeError` and the Kubernetes client's ``ApiException``.
    Never the headers or the request, which can carry the bearer token; any other error is
    named by its type only (its text may carry a URL).
    """
    if isinstance(e, KubeError):
        return str(e)
    if isinstance(e, ApiException):
        body = _status_body(e)
        reason = body.get("reason") or e.reason or ""
        message = body.get("message") or ""
        return f"HTTP {e.status}: {reason}: {message}".rstrip(": ")
    return type(e).__name__


def _is_already_exists(e: ApiException) -> bool:
    if e.status != 409:
        return False
    try:
        return bool(json.loads(e.body or "{}").get("reason") == "AlreadyExists")
    except ValueError:
        return False


class Kube:
    """Async wrappers around the few API calls the operator makes."""

    def __init__(self, api_client: Any, *, threads: int = API_THREADS) -> None:
        self._api: Any = api_client
        self._core: Any = k8s_client.CoreV1Api(api_client)
        self._custom: Any = k8s_client.CustomObjectsApi(api_client)
        self._coordination: Any = k8s_client.CoordinationV1Api(api_client)
        self._threads = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kube")

    async def _run(self, call: Callable[..., _R], *args: Any, **kwargs: Any) -> _R:
        """Run one blocking client call on this API layer's own threads."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, functools.partial(call, *args, **kwargs))

    async def _unless_gone(
        self, what: str, call: Callable[..., _R], *args: Any, **kwargs: Any
    ) -> _R | None:
        """:meth:`_run` ``call``; None when its object is gone (404), and any other refusal
        raised as a :class:`KubeError` that names ``what`` ("reading pod ns/name")."""
        try:
            return await self._run(call, *args, **kwargs)
        except ApiException as e:
            if e.status == 404:
                return None
            raise _translate(e, what) from e

    async def _read_raw(
        self, what: str, read: Callable[..., Any], name: str, namespace: str
    ) -> dict[str, Any] | None:
        """The object ``read`` returns, as raw JSON (no generated models); None when gone."""
        resp = await self._unless_gone(what, read, name, namespace, _preload_content=False)
        return None if resp is None else cast(dict[str, Any], json.loads(resp.data))

    @_needs(crd.GROUP, crd.PLURAL, "get")
    async def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        """Return the TrainingJob, or None when it is gone."""
        job = await self._unless_gone(
            f"reading TrainingJob {namespace}/{name}",
            self._custom.get_namespaced_custom_object,
            crd.GROUP,
            crd.VERSION,
            namespace,
            crd.PLURAL,
            name,
        )
        return None if job is None else cast(dict[str, Any], job)

    @_needs(crd.GROUP, f"{crd.PLURAL}/status", "patch")
    async def patch_job_status(
        self,
        namespace: str,
        name: str,
        status: dict[str, Any],
        *,
        resource_version: str | None = None,
    ) -> str | None:
        """Merge ``status`` into the TrainingJob's status subresource; return the object's new
        resourceVersion (None when the job is gone, or the answer carried none).

        With ``resource_version`` the write is guarded: the API server applies it only to that
        version of the object, and a job changed since it was read raises
        :class:`KubeConflictError` (read afresh and decide again; never resend). Without it the
        merge is applied to whatever is there, retried on a 409.
        """
        body: dict[str, Any] = {"status": status}
        if resource_version is not None:
            body["metadata"] = {"resourceVersion": resource_version}
        for attempt in range(_CONFLICT_RETRIES):
            try:
                answer = await self._run(
                    self._custom.patch_namespaced_custom_object_status,
                    crd.GROUP,
                    crd.VERSION,
                    namespace,
                    crd.PLURAL,
                    name,
                    body,
                )
            except ApiException as e:
                guarded = resource_version is not None
                if e.status == 409 and not guarded and attempt + 1 < _CONFLICT_RETRIES:
                    await asyncio.sleep(0.2 * (attempt + 1))
                    continue
                if e.status == 404:
                    return None
                raise _translate(e, f"patching TrainingJob {namespace}/{name} status") from e
            version = ((answer or {}).get("metadata") or {}).get("resourceVersion")
            return None if version is None else str(version)
        raise AssertionError("unreachable")  # pragma: no cover

    @_needs("", "nodes", "list")
    async def list_node_names(self, *, only: str | None = None) -> set[str]:
        """The names of every Node now, or of the Node named ``only`` if it exists (the Node
        watch's deletions can be missed: see ClusterView.sweep)."""
        selector = None if only is None else f"metadata.name={only}"
        try:
            resp = await self._run(
                self._core.list_node, field_selector=selector, _preload_content=False
            )
        except ApiException as e:
            raise _translate(e, "listing nodes") from e
        items: list[dict[str, Any]] = json.loads(resp.data)["items"]
        return {str((n.get("metadata") or {}).get("name", "")) for n in items}

    @_needs_node_lease
    async def node_lease(self, node: str) -> NodeLease | None:
        """``node``'s Lease (its renew time and duration), or None when it has none. Needs
        :data:`NODE_LEASE_PERMISSIONS` in :data:`NODE_LEASE_NAMESPACE`."""
        lease = await self._read_raw(
            f"reading node Lease {NODE_LEASE_NAMESPACE}/{node}",
            self._coordination.read_namespaced_lease, node, NODE_LEASE_NAMESPACE,
        )  # fmt: skip
        if lease is None:
            return None
        spec = lease.get("spec") or {}
        renewed, duration = spec.get("renewTime"), spec.get("leaseDurationSeconds")
        return NodeLease(
            renew_time=None if renewed is None else str(renewed),
            duration_seconds=float(duration) if isinstance(duration, int | float) else None,
        )

    @_needs("", "pods", "list")
    async def list_pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        """Return the pods matching ``label_selector`` as plain dicts."""
        try:
            resp = await self._run(
                self._core.list_namespaced_pod,
                namespace,
                label_selector=label_selector,
                _preload_content=False,
            )
        except ApiException as e:
            raise _translate(e, f"listing pods in {namespace}") from e
        items: list[dict[str, Any]] = json.loads(resp.data)["items"]
        return items

    @_needs("", "pods", "create")
    async def create_pod(self, namespace: str, body: dict[str, Any]) -> bool:
        """Create a pod; return False when it already existed (idempotent re-runs)."""
        return await self._create("pods", namespace, body, "pod")

    @_needs("", "pods", "delete")
    async def delete_pod(self, namespace: str, name: str, *, grace_seconds: int | None) -> None:
        """Delete a pod (gone already is fine)."""
        await self._unless_gone(
            f"deleting pod {namespace}/{name}",
            self._core.delete_namespaced_pod,
            name,
            namespace,
            grace_period_seconds=grace_seconds,
            propagation_policy="Background",
        )

    @_needs("", "pods", "patch")
    async def patch_pod_annotations(
        self, namespace: str, name: str, annotations: Mapping[str, str | None]
    ) -> None:
        """Merge ``annotations`` into a pod's (None removes a key); a pod gone is fine."""
        body = {"metadata": {"annotations": dict(annotations)}}
        await self._unless_gone(
            f"patching pod {namespace}/{name}'s annotations",
            self._core.patch_namespaced_pod,
            name,
            namespace,
            body,
            _content_type="application/merge-patch+json",
        )

    @_needs("", "services", "create")
    async def create_service(self, namespace: str, body: dict[str, Any]) -> bool:
        """Create a Service; return False when it already existed."""
        return await self._create("services", namespace, body, "service")

    @_needs("", "services", "get", "delete")
    async def delete_owned_service(self, namespace: str, name: str, owner_uid: str) -> bool:
        """Delete the Service ``name`` if the object with uid ``owner_uid`` owns it; return
        whether one was deleted.

        A Service that is gone (or was never created) is fine, and one that is not owned (a
        user's Service of the same name, which :meth:`create_service` took for the job's own)
        is left alone. The delete is conditional on the uid just read, so a Service created
        again in between is not deleted either.
        """
        what = f"service {namespace}/{name}"
        service = await self._read_raw(
            f"reading {what}", self._core.read_namespaced_service, name, namespace
        )
        if service is None:
            return False
        meta = service.get("metadata") or {}
        if not any(o.get("uid") == owner_uid for o in meta.get("ownerReferences") or []):
            return False
        try:
            await self._run(
                self._core.delete_namespaced_service, name, namespace,
                body={"preconditions": {"uid": meta.get("uid")}},
            )  # fmt: skip
        except ApiException as e:
            if e.status in (404, 409):  # gone, or another object of that name now
                return False
            raise _translate(e, f"deleting {what}") from e
        return True

    @_needs("scheduling.k8s.io", "podgroups", "create")
    async def create_pod_group(self, namespace: str, body: dict[str, Any]) -> bool:
        """Create a ``scheduling.k8s.io/v1beta1`` PodGroup; return False when it existed."""
        return await self._create(
            "podgroups", namespace, body, "PodGroup",
            prefix="/apis/scheduling.k8s.io/v1beta1",
        )  # fmt: skip

    @_needs("scheduling.k8s.io", "podgroups", "delete")
    async def delete_pod_group(self, namespace: str, name: str) -> None:
        """Delete a PodGroup (gone already is fine). Its finalizer keeps it until no pod
        uses it any more (the controller-manager's podgroup-protection controller)."""
        await self._unless_gone(
            f"deleting PodGroup {namespace}/{name}",
            self._custom.delete_namespaced_custom_object,
            "scheduling.k8s.io",
            "v1beta1",
            namespace,
            "podgroups",
            name,
        )

    async def serves(self, group_version: str, plural: str) -> bool:
        """Whether the API server serves ``plural`` in ``group_version`` (e.g.
        ``scheduling.k8s.io/v1beta1``), from its discovery document.

        Discovery needs no RBAC rule of the operator's own: every authenticated client may
        read it (the built-in ``system:discovery`` role). A group that is not served answers
        404; any other error is raised, so that a caller never mistakes an outage for "no".
        """
        path = f"/apis/{group_version}" if "/" in group_version else f"/api/{group_version}"
        try:
            data = await self._unless_gone(f"discovering {group_version}", self._get_json, path)
        except (OSError, Urllib3Error) as e:
            # No answer (a refused connection, a timeout): an outage, retried by the caller.
            raise KubeError.from_answer(
                f"discovering {group_version}: no answer from the API server ({type(e).__name__})",
                status=0,
            ) from e
        if data is None:
            return False
        resources = data.get("resources") or []
        return any(isinstance(r, dict) and r.get("name") == plural for r in resources)

    def _get_json(self, path: str) -> dict[str, Any]:
        answer = self._call_json("GET", path)
        return answer if isinstance(answer, dict) else {}

    def _call_json(
        self,
        method: str,
        path: str,
        *,
        path_params: dict[str, str] | None = None,
        body: dict[str, Any] | None = None,
    ) -> Any:
        """One raw JSON request (no generated models), its answer decoded; a status outside 2xx
        raises ApiException, as the generated client does."""
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        params = self._api.param_serialize(
            method=method,
            resource_path=path,
            path_params=path_params or {},
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        resp = self._api.call_api(*params)
        resp.read()
        if not 200 <= resp.status <= 299:
            raise ApiException.from_response(
                http_resp=resp, body=resp.data.decode("utf-8", "replace"), data=None
            )
        return json.loads(resp.data) if resp.data else None

    @_needs("", "secrets", "create")
    async def create_secret(self, namespace: str, body: dict[str, Any]) -> bool:
        """Create a Secret; return False when it already existed."""
        return await self._create("secrets", namespace, body, "secret")

    @_needs("", "secrets", "get")
    async def read_secret_key(self, namespace: str, name: str, key: str) -> str | None:
        """Return one decoded key of a Secret, or None when the Secret or key is missing."""
        import base64

        secret = await self._read_raw(
            f"reading Secret {namespace}/{name}", self._core.read_namespaced_secret, name, namespace
        )
        if secret is None:
            return None
        data = secret.get("data") or {}
        if key not in data:
            return None
        return base64.b64decode(data[key]).decode()

    async def _create(
        self, plural: str, namespace: str, body: dict[str, Any], kind: str, *,
        prefix: str = "/api/v1",
    ) -> bool:  # fmt: skip
        # Sent as the raw JSON the user wrote, not through the client's generated models: those
        # re-validate the body and refuse what the API server accepts (client 37 rejects the
        # integer quantity in `nvidia.com/gpu: 8`, the way every GPU manifest is written).
        name = body.get("metadata", {}).get("name", "?")
        try:
            await self._run(
                self._post_json, f"{prefix}/namespaces/{{namespace}}/{plural}", namespace, body
            )
        except ApiException as e:
            if _is_already_exists(e):
                return False
            raise _translate(e, f"creating {kind} {namespace}/{name}") from e
        return True

    def _post_json(self, path: str, namespace: str, body: dict[str, Any]) -> None:
        self._call_json("POST", path, path_params={"namespace": namespace}, body=body)
