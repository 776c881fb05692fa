"""The layout promises: three import packages, none of them shadowing the standard library.

These run real interpreters from the repo root, because that is where `operator/` could shadow
`import operator` if it ever became a package.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import zipfile
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
    "module",
    [
        "baton_operator",
        "baton_sidecar",
        "trainer_sdk",
        "trainer_sdk.storage",
        # the SDK modules the sidecar imports, through their folders' __init__
        "trainer_sdk.format.layout",
        "trainer_sdk.control",
        "trainer_sdk.replication",
    ],
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


def test_the_wheel_holds_every_module_of_the_three_packages(tmp_path: Path) -> None:
    # pyproject.toml lists the packages by name: a sub-package left out of that list is missing
    # from the wheel (and from every image built with `pip install .`), while an editable
    # install and the tests still import it from the checkout. trainer_sdk.integrations.dcp was.
    # Built from a copy: setuptools leaves build/ and an egg-info beside the sources it builds.
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__")
    for part in ("trainer_sdk", "sidecar/baton_sidecar", "operator/baton_operator"):
        shutil.copytree(REPO / part, src / part, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    proc = subprocess.run(
        [*pip_wheel, "--quiet", "--wheel-dir", str(tmp_path), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("baton-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        in_wheel = {n for n in zf.namelist() if n.endswith(".py")}
    roots = {
        "trainer_sdk": REPO / "trainer_sdk",
        "baton_sidecar": REPO / "sidecar" / "baton_sidecar",
        "baton_operator": REPO / "operator" / "baton_operator",
    }
    in_tree = {
        f"{name}/{path.relative_to(root).as_posix()}"
        for name, root in roots.items()
        for path in root.rglob("*.py")
    }
    missing = sorted(in_tree - in_wheel)
    assert not missing, (
        f"{len(missing)} modules are not in the wheel: {missing[:8]}; add their packages to "
        "[tool.setuptools] packages in pyproject.toml"
    )
