"""The container spec documented in ``docs/sidecar.md`` meets ``restricted`` and really runs.

The operator builds the spec; this keeps the documented shape honest: it must pass the Pod
Security ``restricted`` rules (plus a read-only root filesystem), and the real sidecar must start
from exactly its environment, with the documented probe answering.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import requests
import yaml
from baton_testing.podsecurity import restricted_violations
from baton_testing.ports import free_port
from baton_testing.sidecar_process import SidecarProcess

DOC = Path(__file__).resolve().parents[2] / "docs" / "sidecar.md"


def _documented_pod_spec() -> dict[str, Any]:
    text = DOC.read_text()
    section = text.split("## Container spec", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.DOTALL)
    assert block, "docs/sidecar.md lost its container spec"
    spec: dict[str, Any] = yaml.safe_load(block.group(1))
    return spec


def _sidecar_container(spec: dict[str, Any]) -> dict[str, Any]:
    (container,) = [c for c in spec["initContainers"] if c["name"] == "baton-sidecar"]
    assert isinstance(container, dict)
    return container


def test_documented_spec_is_a_restricted_native_sidecar() -> None:
    spec = _documented_pod_spec()
    spec["containers"] = [
        {
            "name": "trainer",
            "image": "trainer",
            "securityContext": {
                "allowPrivilegeEscalation": False,
                "capabilities": {"drop": ["ALL"]},
                "readOnlyRootFilesystem": True,
            },
        }
    ]
    assert restricted_violations(spec) == []
    container = _sidecar_container(spec)
    assert container["restartPolicy"] == "Always", "a native sidecar is an init container"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["ports"] == [{"name": "baton-ctl", "containerPort": 9440, "protocol": "TCP"}]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["baton-control"]["mountPath"] == "/var/run/baton/control"
    assert mounts["baton-token"]["readOnly"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["baton-control"] == {"name": "baton-control", "emptyDir": {}}
    # A 0440 Secret is readable by the non-root sidecar only through the pod's fsGroup.
    assert volumes["baton-token"]["secret"]["defaultMode"] == 0o440
    assert spec["securityContext"]["fsGroup"] == container["securityContext"]["runAsUser"]


def test_the_sidecar_starts_from_the_documented_environment(tmp_path: Path) -> None:
    container = _sidecar_container(_documented_pod_spec())
    port = free_port()
    env: dict[str, str] = {}
    for item in container["env"]:
        if "valueFrom" in item:
            assert item == {
                "name": "POD_IP",
                "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
            }
            env["POD_IP"] = "127.0.0.1"
            continue
        value = str(item["value"]).replace("/var/run/baton", str(tmp_path))
        env[item["name"]] = value
    env["BATON_SIDECAR_PORT"] = str(port)
    env["BATON_CLOUD"] = "none"  # no metadata endpoint here
    proc = SidecarProcess(tmp_path / "run", control_dir=tmp_path / "control")
    token_file = Path(env["BATON_SIDECAR_TOKEN_FILE"])
    token_file.parent.mkdir(parents=True, exist_ok=True)
    token_file.write_text(proc.token)
    proc.env.update(env)
    proc.args = []  # the documented spec passes no flags
    proc.port = port
    proc.start()
    try:
        probe = container["livenessProbe"]["httpGet"]
        r = requests.get(f"http://127.0.0.1:{port}{probe['path']}", timeout=5)
        assert r.status_code == 200
        assert proc.status().status_code == 200
    finally:
        assert proc.stop() == 0
