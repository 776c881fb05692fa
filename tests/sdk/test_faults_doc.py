"""docs/faults.md: every row names a test, and every test it names exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_REF = re.compile(r"`(test_[a-z0-9_]+\.py)(?:::(test_[a-z0-9_]+)(?:\[[^\]]+\])?)?`")


def _rows() -> list[str]:
    text = (REPO / "docs" / "faults.md").read_text()
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and not ln.startswith("| -")]
    return [r for r in rows if not r.startswith("| fault")]


def test_every_row_names_a_test_that_exists() -> None:
    rows = _rows()
    assert len(rows) > 20
    for row in rows:
        refs = _REF.findall(row.split("|")[-2])
        assert refs, f"a row of docs/faults.md without a test: {row[:80]}"
        for file, name in refs:
            path = REPO / "tests" / "sdk" / file
            assert path.exists(), f"{file} (docs/faults.md) does not exist"
            if name:
                assert re.search(rf"^def {name}\(", path.read_text(), re.MULTILINE), (
                    f"{file}::{name} (docs/faults.md) does not exist"
                )
