"""What the integrations refuse, and how they stop on a notice, in one process.

Each refusal is a setting whose meaning a Baton checkpoint cannot keep; the message names the
fix. The torchtitan manager's exit on a notice is produced for real: a notice requested
through the Checkpointer, served at torchtitan's ``save()`` call.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from torch.utils.data import IterableDataset
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

from trainer_sdk.integrations import IntegrationError
from trainer_sdk.integrations.torchtitan import BatonCheckpointManager
from trainer_sdk.integrations.transformers import BatonTrainer, BatonTrainerMixin, baton_trainer

SEQ = 8


def _model() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=1,
        max_position_embeddings=SEQ,
    )
    return transformers.LlamaForCausalLM(config)


class _Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int = 12) -> None:
        self.ids = torch.randint(0, 32, (n, SEQ), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _args(tmp_path: Path, **kw: Any) -> Any:
    base: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"),
        "use_cpu": True,
        "report_to": [],
        "disable_tqdm": True,
        "per_device_train_batch_size": 2,
        "save_strategy": "steps",
        "save_steps": 3,
        "max_steps": 3,
        "logging_steps": 1,
    }
    return transformers.TrainingArguments(**{**base, **kw})


@pytest.mark.parametrize(
    ("setting", "fix"),
    [
        ({"load_best_model_at_end": True, "eval_strategy": "steps"}, "export_hf"),
        ({"save_only_model": True}, "leave it False"),
        ({"auto_find_batch_size": True}, "per_device_train_batch_size"),
        ({"ignore_data_skip": True}, "leave it False"),
        ({"train_sampling_strategy": "group_by_length"}, "'random' or 'sequential'"),
    ],
)
def test_trainer_arguments_that_cannot_resume_exactly_are_refused(
    tmp_path: Path, setting: dict[str, Any], fix: str
) -> None:
    with pytest.raises(IntegrationError, match=fix):
        BatonTrainer(
            model=_model(),
            args=_args(tmp_path, **setting),
            train_dataset=_Tokens(),
            eval_dataset=_Tokens(),
        )


def test_trainer_refuses_its_own_resume_options_and_iterable_data(tmp_path: Path) -> None:
    with pytest.raises(IntegrationError, match="BatonTrainer takes from the Trainer"):
        BatonTrainer(
            model=_model(),
            args=_args(tmp_path),
            train_dataset=_Tokens(),
            baton_options={"keep_last": 2},
        )
    trainer = BatonTrainer(model=_model(), args=_args(tmp_path), train_dataset=_Tokens())
    with pytest.raises(IntegrationError, match="without it"):
        trainer.train(resume_from_checkpoint=True)

    class Stream(IterableDataset[dict[str, torch.Tensor]]):
        def __iter__(self) -> Any:
            yield from _Tokens()

    streaming = BatonTrainer(
        model=_model(), args=_args(tmp_path, max_steps=2), train_dataset=Stream()
    )
    with pytest.raises(IntegrationError, match="map-style"):
        streaming.train()


def test_enable_jit_checkpoint_is_refused_before_it_installs_a_sigterm_handler(
    tmp_path: Path,
) -> None:
    before = signal.getsignal(signal.SIGTERM)
    for call in (
        lambda: BatonTrainer(
            model=_model(),
            args=_args(tmp_path, enable_jit_checkpoint=True),
            train_dataset=_Tokens(),
        ),
        lambda: BatonTrainer(_model(), _args(tmp_path, enable_jit_checkpoint=True)),
    ):
        with pytest.raises(IntegrationError, match="set enable_jit_checkpoint=False"):
            call()
        # transformers' CheckpointManager would have replaced it in Trainer.__init__
        assert signal.getsignal(signal.SIGTERM) is before


def test_baton_trainer_combines_with_trainer_subclasses_and_refuses_own_loaders() -> None:
    from trl import DPOTrainer, GRPOTrainer, SFTTrainer

    sft = baton_trainer(SFTTrainer)
    assert sft.__name__ == "BatonSFTTrainer"
    assert sft.__mro__[1:3] == (BatonTrainerMixin, SFTTrainer)
    assert baton_trainer(SFTTrainer) is sft, "built once per base"
    assert baton_trainer(sft) is sft
    assert baton_trainer(BatonTrainer) is BatonTrainer
    assert issubclass(baton_trainer(DPOTrainer), DPOTrainer)
    assert BatonTrainer.__mro__[1:3] == (BatonTrainerMixin, transformers.Trainer)
    with pytest.raises(IntegrationError, match="overrides get_train_dataloader"):
        baton_trainer(GRPOTrainer)
    with pytest.raises(IntegrationError, match=r"transformers\.Trainer subclass"):
        baton_trainer(torch.nn.Module)


def test_a_subclass_sampler_that_baton_would_replace_is_refused(tmp_path: Path) -> None:
    class Reversed(torch.utils.data.Sampler[int]):
        def __init__(self, n: int) -> None:
            self.n = n

        def __iter__(self) -> Any:
            return iter(range(self.n - 1, -1, -1))

        def __len__(self) -> int:
            return self.n

    class OwnOrder(transformers.Trainer):  # type: ignore[misc]
        def _get_train_sampler(self, train_dataset: Any = None) -> Any:
            if self.args.seed == 99:
                return Reversed(len(self.train_dataset))
            return super()._get_train_sampler(train_dataset)

    own = baton_trainer(OwnOrder)
    refused = own(model=_model(), args=_args(tmp_path, seed=99), train_dataset=_Tokens())
    with pytest.raises(IntegrationError, match=r"chooses a .*Reversed"):
        refused.train()
    # handing back the Trainer's own random order is what Baton replaces: accepted
    plain = own(
        model=_model(), args=_args(tmp_path, max_steps=1, save_steps=1), train_dataset=_Tokens()
    )
    plain.train()
    assert not plain.preempted


def test_a_resume_with_another_batch_size_is_refused_and_names_the_settings(
    tmp_path: Path,
) -> None:
    uri = tmp_path / "ckpt"
    first = BatonTrainer(
        model=_model(), args=_args(tmp_path), train_dataset=_Tokens(), baton_uri=uri
    )
    first.train()
    assert not first.preempted
    manifest = json.loads((uri / "step-000000000003" / "manifest.json").read_text())
    assert manifest["step"] == 3
    other = BatonTrainer(
        model=_model(),
        args=_args(tmp_path, per_device_train_batch_size=3, max_steps=6),
        train_dataset=_Tokens(),
        baton_uri=uri,
    )
    with pytest.raises(IntegrationError, match="per_device_train_batch_size"):
        other.train()


def test_a_resume_with_a_larger_max_steps_trains_up_to_it(tmp_path: Path) -> None:
    """As the Trainer's own resume: max_steps is this run's, not the checkpoint's."""
    uri = tmp_path / "ckpt"
    first = BatonTrainer(
        model=_model(), args=_args(tmp_path), train_dataset=_Tokens(), baton_uri=uri
    )
    first.train()
    longer = BatonTrainer(
        model=_model(), args=_args(tmp_path, max_steps=6), train_dataset=_Tokens(), baton_uri=uri
    )
    longer.train()
    assert (longer.state.global_step, longer.state.max_steps) == (6, 6)
    assert sorted(p.name for p in uri.glob("step-*")) == ["step-000000000003", "step-000000000006"]


@pytest.mark.parametrize(
    ("setting", "fix"),
    [
        ({"last_save_in_hf": True}, "export_hf"),
        ({"initial_load_path": "/x/dcp"}, "pickle"),
        ({"exclude_from_loading": ["dataloader"]}, "another uri"),
        ({"load_step": 5}, "delete_step"),
    ],
)
def test_torchtitan_settings_that_cannot_be_honoured_are_refused(
    setting: dict[str, Any], fix: str
) -> None:
    with pytest.raises(IntegrationError, match=fix):
        BatonCheckpointManager.Config(enable=True, **setting)


def test_torchtitan_manager_exits_75_after_the_notice_is_committed(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 4)
    optimizers = default_adamw(lr=1e-2).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(
        optimizers=optimizers, training_steps=10
    )

    class State:
        step = 0

        def state_dict(self) -> dict[str, int]:
            return {"step": self.step}

        def load_state_dict(self, sd: dict[str, int]) -> None:
            self.step = sd["step"]

    manager = BatonCheckpointManager.Config(enable=True, interval=100, uri=str(tmp_path)).build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": State()},
        sd_adapter=None,
    )
    assert not manager.load()
    model(torch.ones(2, 4)).sum().backward()
    optimizers.step()
    manager.checkpointer.request_checkpoint(reason="test notice")
    with pytest.raises(SystemExit) as exited:
        manager.save(1)
    assert exited.value.code == 75
    manifest = json.loads((tmp_path / "step-000000000001" / "manifest.json").read_text())
    assert manifest["step"] == 1
    assert any(k.startswith("extra.model.") for k in manifest["tensors"])
    assert any(k.startswith("extra.optimizer.") for k in manifest["tensors"])
