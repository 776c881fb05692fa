"""The tool scripts the Makefile runs: helm built from Go modules, Debian's Prometheus."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)


def test_helm_build_is_cached_and_knows_its_versions(helm: str, tmp_path: Path) -> None:
    again = _run(str(ROOT / "tools" / "helm" / "build.sh"))
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip().splitlines()[-1] == helm
    assert "cached build" in again.stderr
    go_mod = (ROOT / "tools" / "helm" / "go.mod").read_text()
    pinned = re.search(r"helm\.sh/helm/v3 (v\S+)", go_mod)
    assert pinned is not None
    version = _run(helm, "version", "--short")
    assert version.stdout.startswith(pinned.group(1)), version.stdout
    # Offline rendering assumes the Kubernetes minor of the client-go helm was built with
    # (set by build.sh's ldflags, as helm's own Makefile does), not helm's fallback v1.20.
    chart = tmp_path / "probe"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: probe\nversion: 0.1.0\n")
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: probe}\n"
        "data: {kube: {{ .Capabilities.KubeVersion.Version | quote }}}\n"
    )
    client_go = re.search(r"k8s\.io/client-go v0\.(\d+)\.", go_mod)
    assert client_go is not None
    rendered = _run(helm, "template", str(chart))
    assert f'kube: "v1.{client_go.group(1)}.0"' in rendered.stdout, rendered.stdout


def test_prometheus_script_finds_or_installs_both_binaries() -> None:
    result = _run(str(ROOT / "tools" / "prometheus.sh"))
    assert result.returncode == 0, result.stderr
    server = Path(result.stdout.strip().splitlines()[-1])
    assert server.name == "prometheus"
    assert server.is_file()
    assert "prometheus, version" in result.stderr
    promtool = _run("promtool", "--version")
    assert promtool.returncode == 0
