"""The layout promises: three import packages, none of them shadowing the standard library.

These run real interpreters from the repo root, because that is where `operator/` could shadow
`import operator` if it ever became a package.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_stdlib_operator_is_not_shadowed_from_repo_root() -> None:
    proc = run_python(
        "import operator, sys; assert operator.add(2, 3) == 5, operator; "
        "print(getattr(operator, '__file__', '<builtin>'))"
    )
    assert proc.returncode == 0, proc.stderr
    assert str(REPO / "operator") not in proc.stdout
    assert not (REPO / "operator" / "__init__.py").exists(), (
        "operator/ must stay a plain folder: an __init__.py would shadow the stdlib module"
    )


@pytest.mark.parametrize(
    "module", ["baton_operator", "baton_sidecar", "trainer_sdk", "trainer_sdk.storage"]
)
def test_light_imports_do_not_import_torch(module: str) -> None:
    # The operator must never need torch; the sidecar imports only the torch-free control
    # format; the SDK's package import is lazy so that the sidecar can use trainer_sdk.control.
    proc = run_python(f"import sys, {module}; print('torch' in sys.modules)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False", f"importing {module} imported torch"


def test_sdk_public_names_resolve_lazily() -> None:
    import trainer_sdk

    assert trainer_sdk.__version__ == importlib.metadata.version("baton")
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        _ = trainer_sdk.no_such_name  # type: ignore[attr-defined]
    assert set(trainer_sdk.__all__) >= {"save", "load", "latest_step", "Checkpointer"}


def test_console_scripts_point_at_real_callables() -> None:
    scripts = {
        ep.name: ep
        for ep in importlib.metadata.entry_points(group="console_scripts")
        if ep.dist is not None and ep.dist.name == "baton"
    }
    assert {"baton-operator", "baton-sidecar"} <= set(scripts)
    for ep in scripts.values():
        assert callable(ep.load()), ep


def test_storage_uri_routing_rejects_nothing_silently(tmp_path: Path) -> None:
    from trainer_sdk.storage import Storage, open_storage

    local = open_storage(str(tmp_path))
    assert isinstance(local, Storage)
    assert open_storage(f"file://{tmp_path}").uri == local.uri
