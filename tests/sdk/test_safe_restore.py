"""restore() never deletes, and never falls back silently past a step that may be good.

Each fault is produced for real on the local filesystem: a manifest from a newer format
version, an unknown dtype, a real EACCES for a non-root reader, a manifest that fails
validation, a shard gone missing, ``latest`` replaced by a directory, a planted pickle.
The error taxonomy under test is listed in docs/format.md ("Restore rules").
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle  # noqa: TID251 - to plant a pickle and to prove nothing unpickles it
import pwd
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from baton_testing.dist import run_ranks
from torch import nn

import trainer_sdk
from trainer_sdk import api
from trainer_sdk.checkpointer import Checkpointer, ResumeError
from trainer_sdk.control import ControlChannel, State
from trainer_sdk.errors import (
    CorruptCheckpointError,
    ManifestError,
    UnsupportedFormatError,
)
from trainer_sdk.format.layout import FORMAT_VERSION

STEP1, STEP2 = "step-000000000001", "step-000000000002"


def _model(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.ones(3, 4)).square().mean().backward()
    opt.step()


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _two_steps(root: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model, opt = _model()
    with Checkpointer(str(root), model=model, optimizer=opt, handle_sigterm=False) as ck:
        _train(model, opt)
        ck.save(1)
        at1 = _params(model)
        _train(model, opt)
        ck.save(2)
        at2 = _params(model)
    return at1, at2


def _tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` and the sha256 of its bytes (read as root)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _edit_manifest(root: Path, step_dir: str, edit: Any) -> None:
    path = root / step_dir / "manifest.json"
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m))


def _restore_fresh(root: Path) -> tuple[int, nn.Module]:
    model, opt = _model(seed=7)
    with Checkpointer(str(root), model=model, optimizer=opt, handle_sigterm=False) as ck:
        return ck.restore(), model


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (
            lambda m: m.update(version=FORMAT_VERSION + 1),
            rf"format version {FORMAT_VERSION + 1} is not supported.*upgrade",
        ),
        (
            lambda m: next(iter(m["tensors"].values())).update(dtype="F4"),
            r"dtype 'F4'.*upgrade trainer_sdk",
        ),
    ],
    ids=["newer-format-version", "unknown-dtype"],
)
def test_a_checkpoint_from_a_newer_baton_is_raised_and_kept(
    tmp_path: Path, edit: Any, match: str
) -> None:
    _two_steps(tmp_path)
    _edit_manifest(tmp_path, STEP2, edit)
    before = _tree(tmp_path)
    with pytest.raises(UnsupportedFormatError, match=match) as info:
        _restore_fresh(tmp_path)
    assert info.value.step == 2
    assert STEP2 in str(info.value)
    with pytest.raises(UnsupportedFormatError):  # the plain reader agrees: no silent step 1
        trainer_sdk.latest_step(str(tmp_path))
    after = _tree(tmp_path)
    # restore() deleted nothing and changed nothing it read (it may add its fence object)
    assert {k: v for k, v in after.items() if k != "fence"} == {
        k: v for k, v in before.items() if k != "fence"
    }


def test_an_invalid_manifest_is_bad_warns_naming_it_and_falls_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    at1, _ = _two_steps(tmp_path)
    (tmp_path / STEP2 / "manifest.json").write_text('{"format": "baton-checkpoint", "vers')
    caplog.set_level(logging.WARNING, logger="trainer_sdk")
    step, model = _restore_fresh(tmp_path)
    assert step == 1
    assert all(torch.equal(v, at1[k]) for k, v in model.state_dict().items())
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        f"{STEP2}/manifest.json" in r.getMessage() and "not valid JSON" in r.getMessage()
        for r in warned
    ), [r.getMessage() for r in warned]
    assert (tmp_path / STEP2 / "manifest.json").exists()  # kept for inspection


def test_a_file_listed_but_missing_is_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _two_steps(tmp_path)
    shard = tmp_path / STEP2 / "rank-00000-of-00001.safetensors"
    shard.unlink()
    model, _ = _model()
    with pytest.raises(CorruptCheckpointError, match="missing, but the manifest lists it") as e:
        trainer_sdk.load({"model": model.state_dict()}, str(tmp_path), step=2, strict=False)
    assert e.value.path == f"{STEP2}/rank-00000-of-00001.safetensors"
    caplog.set_level(logging.WARNING, logger="trainer_sdk")
    step, _ = _restore_fresh(tmp_path)
    assert step == 1
    assert any(
        "rank-00000-of-00001.safetensors" in r.getMessage() and "missing" in r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING
    )
    assert (tmp_path / STEP2 / "manifest.json").exists()


# ---- a real EACCES: root ignores permissions, so the reader runs as an unprivileged user ----


def _unprivileged() -> tuple[int, int]:
    try:
        pw = pwd.getpwnam("nobody")
    except KeyError:
        pytest.fail("this test needs the 'nobody' user to produce a real EACCES")
    return pw.pw_uid, pw.pw_gid


_READER = """
import json, os, sys
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from trainer_sdk.checkpointer import Checkpointer
torch.manual_seed(7)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
get_state_dict(model, opt)  # its lazy imports, while the interpreter's files are readable
ck = Checkpointer(sys.argv[1], model=model, optimizer=opt, handle_sigterm=False)
# Drop root for good: from here on, permissions apply to this process.
os.setgroups([])
os.setgid(int(sys.argv[3]))
os.setuid(int(sys.argv[2]))
assert os.geteuid() != 0
try:
    out = {"step": ck.restore()}
except Exception as e:
    out = {"type": type(e).__name__, "msg": str(e), "step_attr": getattr(e, "step", None)}
print("RESULT " + json.dumps(out))
"""


@pytest.fixture
def shared_root() -> Iterator[Path]:
    """A checkpoint root that an unprivileged user can reach (pytest's tmp_path is 0700)."""
    root = Path(tempfile.mkdtemp(prefix="baton-eacces-"))
    root.chmod(0o755)
    try:
        yield root / "ckpt"
    finally:
        shutil.rmtree(root)


def _restore_as_nobody(root: Path, unreadable: str) -> tuple[dict[str, Any], dict[str, str]]:
    """Two steps under ``root``, owned by 'nobody', with ``unreadable``'s manifest at mode 000;
    restore() run as 'nobody'. Returns its result and the tree before it ran."""
    if os.geteuid() != 0:
        pytest.fail("run as root: the test switches to an unprivileged user itself")
    uid, gid = _unprivileged()
    _two_steps(root)
    for p in [root, *root.rglob("*")]:
        os.chown(p, uid, gid)
    (root / unreadable / "manifest.json").chmod(0o000)  # its owner, not root: EACCES
    before = _tree(root)
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", _READER, str(root), str(uid), str(gid)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(repo),
        env={**os.environ, "PYTHONPATH": str(repo), "HOME": "/tmp"},
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stdout + proc.stderr
    return json.loads(lines[-1].removeprefix("RESULT ")), before


def test_an_unreadable_manifest_eacces_is_raised_naming_the_step_and_kept(
    shared_root: Path,
) -> None:
    out, before = _restore_as_nobody(shared_root, STEP2)
    assert out.get("type") == "UnreadableCheckpointError", out
    assert out["step_attr"] == 2
    assert "step 2" in out["msg"], out["msg"]
    assert "PermissionError" in out["msg"], out["msg"]
    assert "permissions" in out["msg"]  # the fix is named
    assert _tree(shared_root) == before  # nothing deleted, nothing written over


def test_an_unreadable_older_step_does_not_block_the_newest(shared_root: Path) -> None:
    out, before = _restore_as_nobody(shared_root, STEP1)
    assert out == {"step": 2}, out  # step 1 cannot change which step is newest
    after = _tree(shared_root)
    assert {k: v for k, v in after.items() if k != "fence"} == {
        k: v for k, v in before.items() if k != "fence"
    }


# ---- what restore() and a save do with step directories and `latest` ----------------------


def test_latest_failing_after_the_manifest_is_a_warning_and_the_save_is_committed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root, control = tmp_path / "ckpt", tmp_path / "control"
    control.mkdir()
    _two_steps(root)
    (root / "latest").unlink()
    (root / "latest").mkdir()  # a real fault: `latest` cannot be read or replaced
    (root / "latest" / "x").write_text("in the way")
    caplog.set_level(logging.WARNING, logger="trainer_sdk")
    model, opt = _model()
    with Checkpointer(
        str(root), model=model, optimizer=opt, control_dir=str(control), handle_sigterm=False
    ) as ck:
        assert ck.restore() == 2
        _train(model, opt)
        ck.save(3)  # returns: the manifest is the commit
        saved = _params(model)
    status = ControlChannel(str(control)).read_status()
    assert status is not None
    assert status.state == State.COMMITTED
    assert status.last_committed_step == 3
    assert any(
        "step 3 is committed" in r.getMessage() and "'latest'" in r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING
    ), [r.getMessage() for r in caplog.records]
    step, model2 = _restore_fresh(root)
    assert step == 3
    assert all(torch.equal(v, saved[k]) for k, v in model2.state_dict().items())


def _save_on_two_ranks(root: str) -> None:
    model, opt = _model()  # the same replicated model on both ranks
    with Checkpointer(root, model=model, optimizer=opt, handle_sigterm=False) as ck:
        _train(model, opt)
        ck.save(2)


def test_a_resume_at_another_world_size_is_logged_and_recorded_in_the_next_manifest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_ranks(_save_on_two_ranks, 2, args=(str(tmp_path),), timeout=240)
    assert api.read_manifest(str(tmp_path), 2).world_size == 2
    caplog.set_level(logging.WARNING, logger="trainer_sdk")
    model, opt = _model(seed=5)
    with Checkpointer(str(tmp_path), model=model, optimizer=opt, handle_sigterm=False) as ck:
        assert ck.restore() == 2
        _train(model, opt)
        ck.save(3)
        _train(model, opt)
        ck.save(4)
    assert any("saved by 2 ranks and is loaded by 1" in r.getMessage() for r in caplog.records), [
        r.getMessage() for r in caplog.records
    ]
    assert api.read_manifest(str(tmp_path), 3).extra["baton"]["resume"] == {
        "resumed_from_step": 2,
        "saved_world_size": 2,
        "world_size": 1,
    }
    assert "baton" not in api.read_manifest(str(tmp_path), 4).extra  # the next only


def test_another_torch_minor_version_is_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _two_steps(tmp_path)
    _edit_manifest(tmp_path, STEP2, lambda m: m.update(torch_version="1.13.1"))
    caplog.set_level(logging.WARNING, logger="trainer_sdk")
    step, _ = _restore_fresh(tmp_path)
    assert step == 2
    assert any(
        "saved with torch 1.13.1" in r.getMessage() and torch.__version__ in r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING
    )


def test_an_undeclared_accumulation_setting_is_compared_too(tmp_path: Path) -> None:
    model, opt = _model()
    with Checkpointer(
        str(tmp_path), model=model, optimizer=opt, accumulation_steps=4, handle_sigterm=False
    ) as ck:
        _train(model, opt)
        ck.save(1)
    with (
        Checkpointer(str(tmp_path), model=model, optimizer=opt, handle_sigterm=False) as ck,
        pytest.raises(ResumeError, match=r"accumulation_steps=4.*does not declare"),
    ):
        ck.restore()
    # and the other way round: saved undeclared (1), resumed with 2
    other = tmp_path / "other"
    with Checkpointer(str(other), model=model, optimizer=opt, handle_sigterm=False) as ck:
        ck.save(1)
    with (
        Checkpointer(
            str(other), model=model, optimizer=opt, accumulation_steps=2, handle_sigterm=False
        ) as ck,
        pytest.raises(ResumeError, match=r"accumulation_steps=1.*declares accumulation_steps=2"),
    ):
        ck.restore()


# ---- nothing is ever unpickled --------------------------------------------------------------


class _Bomb:
    """Unpickling this creates ``path``: proof that something unpickled it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (Path(self.path),))


@pytest.fixture
def no_unpickling(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every way to unpickle fails the test (and is recorded), for the duration of a test."""
    calls: list[str] = []

    def refuse(name: str) -> Any:
        def fail(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            raise AssertionError(f"{name} was called while loading a checkpoint")

        return fail

    monkeypatch.setattr(pickle, "loads", refuse("pickle.loads"))
    monkeypatch.setattr(pickle, "load", refuse("pickle.load"))
    monkeypatch.setattr(pickle, "Unpickler", refuse("pickle.Unpickler"))
    monkeypatch.setattr(torch, "load", refuse("torch.load"))
    return calls


def test_planted_pickles_are_never_read_and_a_manifest_naming_one_is_refused(
    tmp_path: Path, no_unpickling: list[str]
) -> None:
    at1, at2 = _two_steps(tmp_path)
    marker = tmp_path.parent / f"{tmp_path.name}-unpickled"
    bomb = pickle.dumps(_Bomb(str(marker)))
    for name in ("model.pt", "optimizer.pkl", "rank-00000-of-00001.pt"):
        (tmp_path / STEP2 / name).write_bytes(bomb)
    step, model = _restore_fresh(tmp_path)  # planted files are not part of the checkpoint
    assert step == 2
    assert all(torch.equal(v, at2[k]) for k, v in model.state_dict().items())
    # a manifest that names a pickle is refused before anything it names is read
    _edit_manifest(
        tmp_path,
        STEP2,
        lambda m: m["files"].update({"model.pt": {"size": len(bomb), "sha256": "0" * 64}}),
    )
    st: dict[str, Any] = {"model": _model(seed=3)[0].state_dict()}
    with pytest.raises(ManifestError, match=r"'model\.pt' is not a plain checkpoint file name"):
        trainer_sdk.load(st, str(tmp_path), step=2)
    step, model = _restore_fresh(tmp_path)  # bad: falls back to step 1, with a warning
    assert step == 1
    assert all(torch.equal(v, at1[k]) for k, v in model.state_dict().items())
    assert not marker.exists()
    assert no_unpickling == []


def test_a_huge_shard_header_is_refused_by_load(tmp_path: Path, no_unpickling: list[str]) -> None:
    """The header length of a shard is attacker-controlled: load() refuses one over the limit
    before allocating anything for it (the CLI's parser has its own test in test_cli.py)."""
    _two_steps(tmp_path)
    shard = tmp_path / STEP2 / "rank-00000-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    huge = 1 << 50
    data[:8] = struct.pack("<Q", huge)
    shard.write_bytes(bytes(data))
    _edit_manifest(
        tmp_path,
        STEP2,
        lambda m: m["files"]["rank-00000-of-00001.safetensors"].update(
            data_start=8 + huge, sha256=hashlib.sha256(data).hexdigest()
        ),
    )
    st: dict[str, Any] = {"model": _model(seed=3)[0].state_dict()}
    with pytest.raises(ManifestError, match="data_start"):
        trainer_sdk.load(st, str(tmp_path), step=2, strict=False)
    assert no_unpickling == []
