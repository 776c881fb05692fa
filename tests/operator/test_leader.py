"""Leader election without a cluster: what a replica does when the API server is not there."""

from __future__ import annotations

import asyncio

import kubernetes
import pytest
from baton_operator.client.leader import LeaseClient
from baton_operator.pure.errors import KubeError
from baton_testing.ports import free_port


def _unreachable_api() -> kubernetes.client.ApiClient:
    config = kubernetes.client.Configuration()
    config.host = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    config.retries = 1  # the client's own retries end in urllib3's MaxRetryError
    return kubernetes.client.ApiClient(config)


def test_no_answer_from_the_api_server_is_a_kube_error_a_standby_retries() -> None:
    # A refused connection surfaced as urllib3's MaxRetryError, which is not an OSError: it
    # escaped the Lease client and ended a standby's process instead of its next retry.
    client = LeaseClient(_unreachable_api(), namespace="baton-system", name="l", timeout=5.0)
    with pytest.raises(KubeError, match="reading Lease baton-system/l: MaxRetryError"):
        asyncio.run(client.get())
    with pytest.raises(KubeError, match="creating Lease baton-system/l: MaxRetryError"):
        asyncio.run(client.create({"holderIdentity": "a"}))
