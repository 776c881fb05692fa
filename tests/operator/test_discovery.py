"""``Kube.serves``: the API discovery that decides whether attempts get a PodGroup.

A real API client against a real HTTP server that answers discovery as the API server does
(a served group's resource list; 404 for a group that is not served), and against a port where
nothing listens (an outage must be an error, never "not served").
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from baton_operator.client.kube import Kube
from baton_operator.pure.errors import KubeError
from baton_testing.ports import free_port
from kubernetes import client as k8s_client

SERVED = {
    "/apis/scheduling.k8s.io/v1beta1": {
        "kind": "APIResourceList",
        "groupVersion": "scheduling.k8s.io/v1beta1",
        "resources": [
            {"name": "podgroups", "namespaced": True, "kind": "PodGroup"},
            {"name": "podgroups/status", "namespaced": True, "kind": "PodGroup"},
            {"name": "workloads", "namespaced": True, "kind": "Workload"},
        ],
    },
    "/apis/scheduling.k8s.io/v1alpha9": {
        "kind": "APIResourceList",
        "groupVersion": "scheduling.k8s.io/v1alpha9",
        "resources": [{"name": "workloads", "namespaced": True, "kind": "Workload"}],
    },
}


class _Discovery(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = SERVED.get(self.path)
        code = 200 if body is not None else 404
        data = json.dumps(body or {"kind": "Status", "code": 404, "reason": "NotFound"})
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data.encode())

    def log_message(self, format: str, *args: object) -> None:
        return None


def _kube(port: int) -> Kube:
    config = k8s_client.Configuration()
    config.host = f"http://127.0.0.1:{port}"
    config.retries = 0
    return Kube(k8s_client.ApiClient(config))


@pytest.fixture
def api_port() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Discovery)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_a_served_group_lists_its_resources_and_an_unserved_one_is_404(api_port: int) -> None:
    kube = _kube(api_port)

    async def run() -> list[bool]:
        return [
            await kube.serves("scheduling.k8s.io/v1beta1", "podgroups"),
            await kube.serves("scheduling.k8s.io/v1alpha9", "podgroups"),
            await kube.serves("scheduling.k8s.io/v1", "podgroups"),
        ]

    assert asyncio.run(run()) == [True, False, False]


def test_no_answer_is_an_error_never_not_served() -> None:
    kube = _kube(free_port())
    with pytest.raises(KubeError) as info:
        asyncio.run(kube.serves("scheduling.k8s.io/v1beta1", "podgroups"))
    assert info.value.status == 0
    assert "no answer from the API server" in str(info.value)
