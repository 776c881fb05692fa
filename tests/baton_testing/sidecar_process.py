"""The real ``baton-sidecar`` process for tests, talked to over HTTP.

Used by the sidecar tests and by anything else that needs a live sidecar (the operator's
client tests, end-to-end runs). Each process gets its own port, control directory, token file
and log; the log is checked for the token at the end of each test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests
from baton_testing.ports import free_port

SIDECAR_BIN = Path(sys.executable).parent / "baton-sidecar"
TOKEN = "tok-3f9a1c-do-not-log-me"
"""The default bearer token; tests assert it never reaches a log."""


class SidecarProcess:
    """One ``baton-sidecar`` subprocess with its own control dir, token file and log."""

    def __init__(
        self,
        tmp: Path,
        *,
        cloud: str = "none",
        env: dict[str, str] | None = None,
        args: list[str] | None = None,
        host: str = "127.0.0.1",
        control_dir: Path | None = None,
        token: str = TOKEN,
    ) -> None:
        self.tmp = tmp
        self.host = host
        self.port = free_port()
        self.control_dir = control_dir or tmp / "control"
        self.token_file = tmp / "token" / "token"
        self.token_file.parent.mkdir(parents=True, exist_ok=True)
        self.token_file.write_text(token + "\n")
        self.token = token
        self.log_path = tmp / f"sidecar-{self.port}.log"
        full_env = {k: v for k, v in os.environ.items() if not k.startswith(("BATON_", "POD_IP"))}
        full_env.update(
            {
                "BATON_CONTROL_DIR": str(self.control_dir),
                "BATON_SIDECAR_TOKEN_FILE": str(self.token_file),
                "BATON_SIDECAR_PORT": str(self.port),
                "BATON_CLOUD": cloud,
                "BATON_SIDECAR_STATUS_INTERVAL": "0.1",
                "BATON_SIDECAR_LOG_LEVEL": "DEBUG",
                # Tests that leave a request unread would each wait the 5 s default on stop;
                # the linger tests (and every pod on the local cluster) use a real one.
                "BATON_SIDECAR_LINGER": "0",
            }
        )
        full_env.update(env or {})
        self.env = full_env
        self.args = ["--host", host, *(args or [])]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, *, wait: bool = True) -> SidecarProcess:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [str(SIDECAR_BIN), *self.args],
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 20.0) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"sidecar exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if requests.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"sidecar did not become ready in {timeout}s:\n{self.log()}")

    def stop(self) -> int:
        """SIGTERM, as the kubelet does; returns the exit status."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    # ---- HTTP -----------------------------------------------------------------------------

    def headers(self, token: str | None = "default") -> dict[str, str]:
        if token is None:
            return {}
        return {"Authorization": f"Bearer {self.token if token == 'default' else token}"}

    def post_checkpoint(
        self,
        body: Any = None,
        *,
        token: str | None = "default",
        data: bytes | None = None,
        content_type: str = "application/json",
    ) -> requests.Response:
        headers = {"Content-Type": content_type, **self.headers(token)}
        return requests.post(
            f"{self.url}/v1/checkpoint",
            json=body if data is None else None,
            data=data,
            headers=headers,
            timeout=10,
        )

    def settle(self, request_id: str, *, token: str | None = "default") -> requests.Response:
        return requests.post(
            f"{self.url}/v1/checkpoint/{request_id}/settled",
            headers=self.headers(token),
            timeout=10,
        )

    def status(self, *, token: str | None = "default") -> requests.Response:
        return requests.get(f"{self.url}/v1/status", headers=self.headers(token), timeout=10)

    def metrics(self) -> str:
        r = requests.get(f"{self.url}/metrics", timeout=10)
        assert r.status_code == 200, r.text
        return r.text


def wait_for(predicate: Callable[[], Any], timeout: float = 15.0, what: str = "condition") -> Any:
    """Poll ``predicate`` until it is truthy; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


__all__ = [
    "SIDECAR_BIN",
    "TOKEN",
    "SidecarProcess",
    "pod_dir",
    "replicating_sidecar",
    "ring_peers",
    "start_ring",
    "wait_for",
]


# -- pods of one job whose sidecars replicate memory snapshots to each other (a ring)


def pod_dir(tmp: Path, k: int) -> Path:
    """The directory of pod ``k`` (its sidecar's control files, its ``fast`` memory tier)."""
    return tmp / f"pod{k}"


def replicating_sidecar(tmp: Path, k: int) -> SidecarProcess:
    """A sidecar for pod ``k`` on its (possibly emptied) directories, not started: its memory
    tier in ``<pod_dir>/fast`` and ``node-<k>`` as its failure domain."""
    d = pod_dir(tmp, k)
    d.mkdir(exist_ok=True)
    p = SidecarProcess(d)
    p.env.update({"BATON_FAST_DIR": str(d / "fast"), "BATON_FAILURE_DOMAIN": f"node-{k}"})
    return p


def ring_peers(pods: list[SidecarProcess], k: int) -> list[dict[str, str]]:
    """Ring order after pod ``k``: its replica target first."""
    n = len(pods)
    return [{"address": pods[(k + i) % n].url, "domain": f"node-{(k + i) % n}"} for i in (1, 2)]


def start_ring(pods: list[SidecarProcess], ks: list[int]) -> None:
    """Start the sidecars ``ks`` with their ring peers; every other (running) sidecar learns
    the new addresses through ``PUT /v1/replication/peers``, as the operator tells it."""
    for k in ks:
        pods[k].env["BATON_REPLICATION_PEERS"] = json.dumps(ring_peers(pods, k))
        pods[k].start()
    for k in range(len(pods)):
        if k not in ks:
            r = requests.put(
                f"{pods[k].url}/v1/replication/peers",
                json={"peers": ring_peers(pods, k)},
                headers=pods[k].headers(),
                timeout=30,
            )
            assert r.status_code == 200, r.text
