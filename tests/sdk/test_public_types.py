"""A user's type checker sees the SDK's real public names, not ``Any``.

``trainer_sdk/__init__.py`` loads its names lazily (module ``__getattr__``, so importing it
does not import torch); type checkers get them from its ``TYPE_CHECKING`` imports. This runs
the real mypy, as a user would, on a script that uses every name in ``trainer_sdk.__all__``
both ways (``trainer_sdk.X`` and ``from trainer_sdk import X``), and reads what it reveals.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import trainer_sdk

SDK_DIR = Path(trainer_sdk.__file__).parent


def _user_script(names: list[str]) -> str:
    lines = ["import trainer_sdk", f"from trainer_sdk import {', '.join(names)}", ""]
    for name in names:
        lines.append(f"reveal_type(trainer_sdk.{name})  # attr {name}")
        lines.append(f"reveal_type({name})  # from {name}")
    return "\n".join(lines) + "\n"


def test_every_public_name_has_a_real_type_for_a_users_mypy(tmp_path: Path) -> None:
    names = sorted(set(trainer_sdk.__all__))
    # the user's environment: only the installed package on the search path (a link, so that
    # the repository's other top-level directories cannot shadow anything)
    site = tmp_path / "site"
    site.mkdir()
    (site / "trainer_sdk").symlink_to(SDK_DIR, target_is_directory=True)
    project = tmp_path / "project"
    project.mkdir()
    script = project / "user_train.py"
    script.write_text(_user_script(names))
    (project / "mypy.ini").write_text("[mypy]\nstrict = True\n")

    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "user_train.py"],
        cwd=project,
        env={**os.environ, "MYPYPATH": str(site), "MYPY_CACHE_DIR": str(tmp_path / "cache")},
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    output = result.stdout + result.stderr
    revealed = re.findall(r'user_train\.py:(\d+): note: Revealed type is "(.*)"', output)
    script_lines = script.read_text().splitlines()
    by_line = {script_lines[int(n) - 1].split("# ", 1)[1]: typ for n, typ in revealed}

    expected = {f"{way} {name}" for name in names for way in ("attr", "from")}
    assert set(by_line) == expected, f"mypy revealed {sorted(by_line)}; output:\n{output}"
    # a signature may take Any (a state dict holds anything); the name itself must not be Any
    untyped = sorted(use for use, typ in by_line.items() if typ == "Any")
    assert not untyped, f"public names a user's mypy sees as Any: {untyped}\n{output}"
    # no error in the user's script (mypy reports errors inside the SDK here only because
    # MYPYPATH makes it user code; from site-packages they are silenced, as for any package)
    errors = [line for line in output.splitlines() if line.startswith("user_train.py:")]
    errors = [line for line in errors if ": error:" in line]
    assert not errors, "\n".join(errors)
    assert by_line["from Checkpointer"].endswith("-> trainer_sdk.checkpointer.Checkpointer")
    assert by_line["attr EXIT_STOPPED_AFTER_NOTICE"] in ("int", "Literal[75]?")


def test_every_public_name_resolves_at_runtime() -> None:
    for name in trainer_sdk.__all__:
        assert getattr(trainer_sdk, name) is not None, name
    assert trainer_sdk.EXIT_STOPPED_AFTER_NOTICE == 75
