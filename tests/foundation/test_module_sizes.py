"""House style: a module over about 600 lines, or a class over about 400, says why in its docstring.

The reason is a sentence that begins ``Why one module of this size:`` (in the module's
docstring) or ``Why one class of this size:`` (in the class's), so that the next reader finds
it where they start reading, and this test finds it too. The rule is for code: the product's
packages, the test helpers, the benchmarks, the examples and the tools. Test modules
(``test_*.py``, ``conftest.py``) are lists of cases and are not held to it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE = ("trainer_sdk", "operator/baton_operator", "sidecar", "tests/baton_testing", "bench",
        "examples", "tools")  # fmt: skip
MODULE_LINES = 600
CLASS_LINES = 400
MODULE_REASON = "Why one module of this size:"
CLASS_REASON = "Why one class of this size:"


def code_modules() -> list[Path]:
    paths = [p for root in CODE for p in sorted((ROOT / root).rglob("*.py"))]
    return [
        p
        for p in paths
        if not p.name.startswith("test_") and p.name != "conftest.py" and ".venv" not in p.parts
    ]


def oversized(path: Path, root: Path = ROOT) -> list[str]:
    """What in ``path`` is over the limits and does not say why (named relative to ``root``)."""
    text = path.read_text()
    tree = ast.parse(text, filename=str(path))
    where = path.relative_to(root)
    found = []
    lines = text.count("\n")
    if lines > MODULE_LINES and MODULE_REASON not in " ".join(
        (ast.get_docstring(tree) or "").split()
    ):
        found.append(f"{where}: {lines} lines, and its docstring has no '{MODULE_REASON}'")
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
            size = node.end_lineno - node.lineno + 1
            doc = " ".join((ast.get_docstring(node) or "").split())
            if size > CLASS_LINES and CLASS_REASON not in doc:
                found.append(
                    f"{where}: class {node.name} is {size} lines, and its docstring has no "
                    f"'{CLASS_REASON}'"
                )
    return found


def test_the_rule_looks_at_the_code() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in code_modules()}
    assert "trainer_sdk/checkpointer.py" in names
    assert "operator/baton_operator/pure/crd.py" in names
    assert "tests/baton_testing/demo.py" in names
    assert not any(Path(n).name.startswith("test_") for n in names)


def test_a_long_module_or_class_without_a_reason_is_found(tmp_path: Path) -> None:
    long_class = "class Big:\n    '''A class.'''\n" + "    x = 1\n" * 450
    body = '"""A module."""\n' + long_class + "y = 2\n" * 200
    (tmp_path / "big.py").write_text(body)
    found = oversized(tmp_path / "big.py", root=tmp_path)
    assert len(found) == 2, found
    assert "class Big is 452 lines" in found[1]


def test_every_long_module_and_class_says_why() -> None:
    found = [f for p in code_modules() for f in oversized(p)]
    assert not found, "say why in the docstring, or split it:\n" + "\n".join(found)
