"""BatonTrainer: a Hugging Face Trainer run on 2 gloo ranks under torchrun, preempted for real,
ends bitwise equal to a run that was never interrupted.

The script (``hf_train.py``) is a stock fine-tune of a tiny LlamaForCausalLM built from a
LlamaConfig (attention dropout on, AdamW, cosine schedule with warmup, gradient accumulation
with a short last group in every epoch, shuffled data). Every micro-batch loss is logged
exactly (float.hex) on every rank; the final weights, optimizer state and learning rates are
saved by rank 0 at the end. The uninterrupted run is ``hf_reference`` (conftest.py), shared
with the operator test.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from baton_testing import hf_runs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def test_sigkill_mid_epoch_twice_resumes_bitwise(hf_reference: Path, tmp_path: Path) -> None:
    # save_steps=3 and 6 optimizer steps per epoch: killed after step 4 (epoch 0) and step 11
    # (epoch 1), resumed from steps 3 and 9, both in the middle of an epoch.
    hf_runs.run_until_hang(tmp_path, 4)
    hf_runs.run_until_hang(tmp_path, 11)
    assert hf_runs.run(tmp_path) == 0, hf_runs.tail(tmp_path)
    hf_runs.assert_same_final(tmp_path, hf_reference)
    for rank in (0, 1):
        ref = hf_runs.by_step(hf_runs.losses(hf_reference, rank))
        assert sorted(ref) == list(range(1, hf_runs.STEPS + 1))
        steps = hf_runs.steps(hf_runs.losses(tmp_path, rank), ref)
        # every step trained, and the only replays are the steps after each checkpoint
        assert steps == [1, 2, 3, 4, *range(4, 12), *range(10, 19)]


def test_sigterm_to_one_rank_saves_the_last_step_and_replays_nothing(
    hf_reference: Path, tmp_path: Path
) -> None:
    # Rank 1 alone gets SIGTERM after step 4 (no periodic save at 4 or 5). The ranks agree on
    # it at a step boundary, save that step, and stop; torchrun reports the exit 75.
    code = hf_runs.run(tmp_path, HF_TEST_SIGTERM_AT="4")
    assert code == 1, hf_runs.tail(tmp_path)
    assert "exitcode  : 75" in hf_runs.tail(tmp_path)
    last = {rank: max(s for s, _ in hf_runs.losses(tmp_path, rank)) for rank in (0, 1)}
    saved = max(int(p.name.removeprefix("step-")) for p in (tmp_path / "ckpt").glob("step-*"))
    manifest = json.loads((tmp_path / "ckpt" / f"step-{saved:012d}" / "manifest.json").read_text())
    assert manifest["trigger"] == "signal"
    assert last == {0: saved, 1: saved}, "the notice save is of the last step trained"
    assert saved in (4, 5)

    assert hf_runs.run(tmp_path) == 0, hf_runs.tail(tmp_path)
    hf_runs.assert_same_final(tmp_path, hf_reference)
    for rank in (0, 1):
        ref = hf_runs.by_step(hf_runs.losses(hf_reference, rank))
        steps = hf_runs.steps(hf_runs.losses(tmp_path, rank), ref)
        assert steps == list(range(1, hf_runs.STEPS + 1)), "a step was replayed or skipped"

    # The run's last checkpoint (save_steps=3: step 18), exported with the model's config,
    # loads with from_pretrained as the trained model.
    _assert_export_loads_as_trained(tmp_path)


def _assert_export_loads_as_trained(out: Path) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    import trainer_sdk

    info = trainer_sdk.export_hf(out / "ckpt", out / "export", config=out / "config.json")
    assert info.step == hf_runs.STEPS
    exported = AutoModelForCausalLM.from_pretrained(out / "export", attn_implementation="eager")
    final = load_file(str(out / "final.safetensors"))
    trained = {k.removeprefix("model."): v for k, v in final.items() if k.startswith("model.")}
    got = exported.state_dict()
    assert got.keys() == trained.keys()
    for key, tensor in trained.items():
        assert got[key].dtype == tensor.dtype, key
        assert got[key].equal(tensor), f"{key} differs from the trained weights"
    model = LlamaForCausalLM(LlamaConfig.from_json_file(str(out / "config.json")))
    model.config._attn_implementation = "eager"
    model.load_state_dict(trained)
    ids = torch.randint(
        0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3)
    )
    with torch.no_grad():
        assert exported.eval()(ids).logits.equal(model.eval()(ids).logits)


def test_resumed_three_rank_runs_exit_cleanly(tmp_path: Path) -> None:
    """A resumed 3-rank run trains to the end and every rank exits 0, every time.

    It used to end with one rank's SIGABRT at interpreter exit ("terminate called without an
    active exception") in about 1 run of 10: the SDK's gloo groups were never destroyed and
    their worker threads freed finished works during the interpreter's finalization
    (trainer_sdk.saveload._collectives.release_group). Killed once, then resumed from that same
    state several times; torchrun's exit code is 0 only when every rank's is.
    """
    killed = tmp_path / "killed"
    hf_runs.run_until_hang(killed, 4, nproc=3)
    for i in range(4):
        out = tmp_path / f"resume-{i}"
        shutil.copytree(killed, out)
        (out / "torchrun.log").unlink()
        code = hf_runs.run(out, nproc=3)
        log = hf_runs.tail(out)
        assert code == 0, f"resume {i}: torchrun exited {code}:\n{log}"
        assert "terminate called" not in log, f"resume {i}:\n{log}"
        # 3 epochs of 4 optimizer steps on 3 ranks (6 on 2: hf_runs.STEPS).
        last = {rank: max(s for s, _ in hf_runs.losses(out, rank)) for rank in range(3)}
        assert last == {0: 12, 1: 12, 2: 12}, f"resume {i}: a rank stopped early: {last}"
        assert (out / "final.safetensors").exists(), f"resume {i}: rank 0 did not finish"
