"""The generated CRD, RBAC, dashboard and rules files match their single sources of truth."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from baton_operator import rbac
from baton_operator.pure import crd

ROOT = Path(__file__).resolve().parents[2]


def test_generated_files_are_up_to_date() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "generate.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, (
        f"{result.stderr}\nThe committed deployment files differ from baton_operator.pure.crd, "
        "baton_operator.rbac, deploy/_dashboard.py or deploy/prometheus/baton-rules.yaml: "
        "run .venv/bin/python deploy/generate.py and commit the result."
    )


def test_chart_and_deploy_carry_the_source_crd() -> None:
    # Independent of the generator's own comparison: parse what Helm and kubectl will read.
    expected = crd.crd_manifest()
    chart_crd = yaml.safe_load(
        (ROOT / "charts" / "baton" / "crds" / "trainingjobs.baton.dev.yaml").read_text()
    )
    deploy_docs = list(yaml.safe_load_all((ROOT / "deploy" / "crd.yaml").read_text()))
    assert chart_crd == expected
    assert deploy_docs[0] == expected
    assert deploy_docs[1:] == []  # kopf's peering CRDs are gone: a Lease elects the operator


def test_deploy_rbac_is_the_source_rbac() -> None:
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "rbac.yaml").read_text()))
    assert docs == rbac.rbac_manifests("baton-system", "baton-operator")
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    assert role["rules"] == rbac.rbac_rules()


def test_a_stale_file_is_detected_and_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Run the generator's check against a copy of the repo's generated files with one edit, to
    # prove that --check really compares content (and says how to fix it).
    import importlib.util

    spec = importlib.util.spec_from_file_location("baton_generate", ROOT / "deploy" / "generate.py")
    assert spec is not None
    assert spec.loader is not None
    sys.path.insert(0, str(ROOT / "deploy"))
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "deploy"))
    chart_crd = ROOT / "charts" / "baton" / "crds" / "trainingjobs.baton.dev.yaml"
    # outputs() reads these module globals at call time: point them at the copy.
    setattr(module, "ROOT", tmp_path)  # noqa: B010
    setattr(module, "CHART", tmp_path / "charts" / "baton")  # noqa: B010
    (tmp_path / "deploy" / "prometheus").mkdir(parents=True)
    (tmp_path / "deploy" / "prometheus" / "baton-rules.yaml").write_text(
        (ROOT / "deploy" / "prometheus" / "baton-rules.yaml").read_text()
    )
    assert module.main([]) == 0  # writes everything into tmp_path
    assert module.main(["--check"]) == 0
    copy = tmp_path / "charts" / "baton" / "crds" / chart_crd.name
    copy.write_text(copy.read_text().replace("Pending", "Pendng", 1))
    capsys.readouterr()
    assert module.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert f"charts/baton/crds/{chart_crd.name}" in err
    assert "deploy/generate.py" in err
