"""The Dockerfiles agree with the chart and with pyproject.toml.

No image can be built here (no container engine), so this checks what can be checked from the
files: the final stage runs as the chart's numeric user, starts the right console script, is
based on a pinned image, carries no build tools, and installs every third-party package that
the component's code imports (and nothing outside pyproject's dependencies).
"""

from __future__ import annotations

import ast
import re
import shlex
import sys
import tomllib
from importlib import metadata
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "deploy" / "images"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VALUES = yaml.safe_load((ROOT / "charts" / "baton" / "values.yaml").read_text())

# component -> (Dockerfile, console script, source files whose imports the image must satisfy)
COMPONENTS = {
    "operator": ("operator.Dockerfile", "baton-operator", [ROOT / "operator" / "baton_operator"]),
    "sidecar": (
        "sidecar.Dockerfile",
        "baton-sidecar",
        [
            ROOT / "sidecar" / "baton_sidecar",
            # the torch-free SDK modules the sidecar imports (import-linter keeps torch out)
            *(
                ROOT / "trainer_sdk" / m
                for m in (
                    "control.py",
                    "wire.py",
                    "replication.py",
                    "format/__init__.py",
                    "format/layout.py",
                    "errors.py",
                    "_version.py",
                )
            ),
        ],
    ),
}


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _final_stage(path: Path) -> list[tuple[str, str]]:
    instructions = _instructions(path)
    starts = [i for i, (word, _) in enumerate(instructions) if word == "FROM"]
    return instructions[starts[-1] :]


def _pip_requirements(path: Path) -> set[str]:
    """Every requirement string passed to `pip install` (quoted specifiers, not paths)."""
    found = set()
    for word, args in _instructions(path):
        if word != "RUN":
            continue
        for command in re.split(r"&&|;", args):
            tokens = shlex.split(command)
            if "install" in tokens and any(t.endswith("pip") for t in tokens[:2]):
                found |= {
                    t
                    for t in tokens[tokens.index("install") + 1 :]
                    if not t.startswith("-") and not t.startswith((".", "/"))
                }
    return found


def _third_party_imports(sources: list[Path]) -> set[str]:
    modules: set[str] = set()
    files = [f for s in sources for f in (s.rglob("*.py") if s.is_dir() else [s])]
    for file in files:
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                modules |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                modules.add(node.module.split(".")[0])
    ours = {"trainer_sdk", "baton_sidecar", "baton_operator"}
    return {m for m in modules if m not in sys.stdlib_module_names and m not in ours}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _with_dependencies(names: set[str]) -> set[str]:
    """``names`` plus what they pull in (from this venv's metadata; extras not followed)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(_canonical(req.name))
    return seen


@pytest.mark.parametrize("component", sorted(COMPONENTS))
def test_final_stage_runs_the_console_script_as_the_charts_user(component: str) -> None:
    dockerfile, script, _ = COMPONENTS[component]
    final = _final_stage(IMAGES / dockerfile)
    users = [args for word, args in final if word == "USER"]
    uid = VALUES["podSecurityContext"]["runAsUser"]
    gid = VALUES["podSecurityContext"]["runAsGroup"]
    assert users == [f"{uid}:{gid}"], f"{dockerfile}: USER must be the chart's {uid}:{gid}"
    entrypoints = [args for word, args in final if word == "ENTRYPOINT"]
    assert entrypoints == [f'["{script}"]']
    assert script in PYPROJECT["project"]["scripts"]


@pytest.mark.parametrize("component", sorted(COMPONENTS))
def test_multi_stage_with_a_pinned_base_and_no_build_tools_at_the_end(component: str) -> None:
    dockerfile = IMAGES / COMPONENTS[component][0]
    instructions = _instructions(dockerfile)
    assert sum(word == "FROM" for word, _ in instructions) >= 2, "expected a multi-stage build"
    base = next(args for word, args in instructions if word == "ARG" and "PYTHON_IMAGE" in args)
    image = base.split("=", 1)[1]
    # An exact patch version and OS release, or a digest: never a floating tag.
    assert re.search(r":\d+\.\d+\.\d+-\S+$|@sha256:[0-9a-f]{64}$", image), image
    final = _final_stage(dockerfile)
    assert final[0][1].startswith("${PYTHON_IMAGE}")
    runs = " ".join(args for word, args in final if word == "RUN")
    for tool in ("apt-get", "gcc", "build-essential", "pip install"):
        assert tool not in runs, f"{dockerfile.name}: {tool!r} in the final stage"
    copies = [args for word, args in final if word == "COPY"]
    assert copies == ["--from=build /opt/baton /opt/baton"]


@pytest.mark.parametrize("component", sorted(COMPONENTS))
def test_installed_packages_cover_the_code_and_come_from_pyproject(component: str) -> None:
    dockerfile, _, sources = COMPONENTS[component]
    installed = _pip_requirements(IMAGES / dockerfile)
    declared = set(PYPROJECT["project"]["dependencies"])
    # Each pin is literally one of pyproject's, so a version bump there shows up here.
    assert installed <= declared, f"not in pyproject.toml: {installed - declared}"
    installed_names = {_canonical(Requirement(r).name) for r in installed}
    dists = packages_distributions()
    needed = {
        _canonical(dist)
        for module in _third_party_imports(sources)
        for dist in dists.get(module, [module])
    }
    assert needed <= _with_dependencies(installed_names), (
        f"{dockerfile} does not install {sorted(needed - installed_names)}, which "
        f"the {component}'s code imports: add them to its pip install line"
    )
    assert "torch" not in _with_dependencies(installed_names), "no torch in these images"


def test_trainer_example_installs_the_sdk_without_replacing_torch() -> None:
    installed = _pip_requirements(IMAGES / "trainer.Dockerfile")
    declared = set(PYPROJECT["project"]["dependencies"])
    assert installed <= declared
    names = {_canonical(Requirement(r).name) for r in installed}
    assert "torch" not in names
    # The integrations plug into a framework the user's image already has (transformers,
    # torchtitan); the example image carries the SDK itself.
    sdk_sources = [f for f in (ROOT / "trainer_sdk").rglob("*.py") if "integrations" not in f.parts]
    sdk_imports = _third_party_imports(sdk_sources) - {"torch"}
    dists = packages_distributions()
    needed = {_canonical(d) for m in sdk_imports for d in dists.get(m, [m])}
    assert needed <= _with_dependencies(names), (
        f"trainer.Dockerfile misses {sorted(needed - names)}"
    )
    runs = " ".join(args for word, args in _instructions(IMAGES / "trainer.Dockerfile"))
    assert "--no-deps" in runs
