"""Export a checkpoint's model weights in the Hugging Face safetensors layout.

A Baton checkpoint holds the whole training state in per-rank shards; serving and evaluation
tools want the model's weights alone, consolidated, as ``model.safetensors`` or as
``model-0000i-of-0000N.safetensors`` plus ``model.safetensors.index.json`` (the layout that
``transformers``' ``from_pretrained`` and ``safetensors`` read). :func:`export_hf` reads any
committed step, saved under any world size (sharded DTensor pieces included), through the
checkpoint reader of :mod:`trainer_sdk.api` (every block checksummed), and writes that layout,
holding at most one output shard in memory.

Which tensors are "the model": the Checkpointer saves the model's ``state_dict`` under the
top-level key ``model``, so every tensor whose key starts with ``model.`` (``prefix``); the
prefix is stripped from the exported names. Shards are cut much like ``huggingface_hub`` does:
tensors in checkpoint order, a new shard when the next tensor would pass ``max_shard_size``, and
a tensor larger than that in a shard of its own (which also closes the shard before it, so the
files follow checkpoint order). When everything fits in one shard, the output is a single
``model.safetensors`` with no index, as ``save_pretrained`` does.

The model's config is written beside the weights as ``config.json``: without it,
``from_pretrained`` on the folder builds a *default* model of the class (for Llama a 7B-shaped
one: slow, and a memory hazard) instead of failing. So :func:`export_hf` refuses to export
without a config, unless told ``weights_only=True``.

A PEFT fine-tune (a ``peft.PeftModel`` saved by the Checkpointer or ``BatonTrainer``) can also
be exported as its adapter alone, in PEFT's own layout: :func:`export_peft_adapter` writes
``adapter_model.safetensors`` (the adapter's tensors under PEFT's names, the adapter name
removed as ``get_peft_model_state_dict`` does) and ``adapter_config.json``, which
``PeftModel.from_pretrained(base_model, out_dir)`` loads. ``BatonTrainer`` records the model's
``peft_config`` in every save (:data:`PEFT_CONFIG_KEY`), so the checkpoint alone is enough;
a plain Checkpointer's step needs the config passed in. ``export_hf(merge_adapter=...)``
writes the base model with a LoRA adapter merged into its weights instead, computed as PEFT's
``merge_and_unload()`` computes it.

Why one module of this size: the whole-model, adapter and merged exports share the step lookup,
the selection of the model's tensors, the streaming into shards and the rule that a failed
export leaves no files behind (and the CLI's runner beside them); split, each would re-import
those private parts.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch
from safetensors.torch import save_file

from trainer_sdk import api
from trainer_sdk.errors import BatonError
from trainer_sdk.format.layout import DTYPE_SIZES
from trainer_sdk.saveload._progress import Progress
from trainer_sdk.storage import Location, Storage, open_storage

__all__ = [
    "CONFIG_FILE",
    "DEFAULT_PREFIX",
    "PEFT_CONFIG_KEY",
    "ExportInfo",
    "HfExportError",
    "export_hf",
    "export_peft_adapter",
    "parse_size",
    "peft_config_doc",
    "run_export_hf",
]

log = logging.getLogger("trainer_sdk.hf")

DEFAULT_PREFIX: Final = "model."
"""The Checkpointer keeps the model's ``state_dict`` under the top-level key ``model``."""
SINGLE_FILE: Final = "model.safetensors"
INDEX_FILE: Final = "model.safetensors.index.json"
CONFIG_FILE: Final = "config.json"
ADAPTER_FILE: Final = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE: Final = "adapter_config.json"
_ADAPTER_MARK: Final = "lora_"
"""What names an adapter tensor in a PeftModel's state dict (LoRA's A/B matrices, embeddings
and DoRA magnitudes all carry it)."""
PEFT_CONFIG_KEY: Final = "peft_config"
"""Where ``BatonTrainer`` records ``model.peft_config`` (adapter name -> the JSON of its
``adapter_config.json``): this key of its ``extra.trainer`` state, in rank 0's JSON tree."""
_PEFT_CONFIG_PATH: Final = ("extra", "trainer", PEFT_CONFIG_KEY)
_LORA_AB_RE: Final = re.compile(r"(.+)\.lora_([AB])\.([^.]+)\.weight")
_PEFT_ROOT: Final = "base_model.model."
"""A ``PeftModel``'s prefix before the wrapped model's own names."""
_SHARD_RE: Final = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# Transformers refuses safetensors files whose metadata lacks a known "format".
_METADATA: Final = {"format": "pt"}
_UNITS: Final = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


class HfExportError(BatonError):
    """The checkpoint cannot be exported as asked (the message says how to fix the call)."""


@dataclass(frozen=True, kw_only=True)
class ExportInfo:
    """What :func:`export_hf` wrote."""

    step: int
    """The checkpoint step exported."""
    out_dir: str
    """The output directory."""
    files: tuple[str, ...]
    """The weight files written, in order (without the index)."""
    tensors: int
    """How many tensors were exported."""
    total_size: int
    """Bytes of tensor data (``metadata.total_size`` of the index)."""
    config: str | None
    """The ``config.json`` written, or None for a ``weights_only`` export."""
    seconds: float
    """Wall time of the export."""


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or ``"5GB"`` (powers of 10) / ``"5GiB"`` (powers of 2)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    elif isinstance(size, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", size)
        unit = m.group(2).upper() if m else None
        if m is None or unit not in _UNITS:
            raise HfExportError(
                f"max_shard_size {size!r} is not a size: write it like '5GB', '500MB', '2GiB' "
                "or give a number of bytes"
            )
        value = math.floor(float(m.group(1)) * _UNITS[unit])
    else:
        raise HfExportError(f"max_shard_size must be an int or a str like '5GB', got {size!r}")
    if value <= 0:
        raise HfExportError(f"max_shard_size must be positive, got {size!r}")
    return value


@dataclass(frozen=True, slots=True)
class _Planned:
    key: str  # key in the checkpoint
    name: str  # exported name (prefix stripped)
    nbytes: int


def _plan(selected: list[_Planned], limit: int) -> list[list[_Planned]]:
    """Group tensors into shards, in checkpoint order (see the module doc)."""
    shards: list[list[_Planned]] = []
    current: list[_Planned] = []
    size = 0
    for item in selected:
        if item.nbytes > limit:
            # Too big for any shard: alone, over the limit. huggingface_hub's splitter keeps the
            # open shard open past it; closing it keeps the files in checkpoint order, which is
            # what lets the export stream with one shard in memory.
            if current:
                shards.append(current)
                current, size = [], 0
            shards.append([item])
            continue
        if current and size + item.nbytes > limit:
            shards.append(current)
            current, size = [], 0
        current.append(item)
        size += item.nbytes
    if current:
        shards.append(current)
    return shards


def _manifest_of(storage: Storage, step: int | None) -> tuple[int, Any]:
    """``step`` (default: the newest complete one) and its manifest, for an export."""
    if step is None:
        step = api.latest_step(storage)
        if step is None:
            raise HfExportError(f"no complete checkpoint under {storage.uri}: nothing to export")
    return step, api.read_manifest(storage, step)


def _select(manifest: Any, prefix: str, step: int) -> list[_Planned]:
    selected: list[_Planned] = []
    for key, entry in manifest.tensors.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix) :]
        if not name:
            raise HfExportError(f"tensor {key!r} has an empty name once {prefix!r} is stripped")
        if entry.kind == "rank_local":
            raise HfExportError(
                f"tensor {key!r} is rank-local (a different value on every rank), so it has no "
                f"single consolidated value: choose a prefix that holds only model weights"
            )
        nbytes = math.prod(entry.shape) * DTYPE_SIZES[entry.dtype]
        selected.append(_Planned(key=key, name=name, nbytes=nbytes))
    if not selected:
        tops = sorted({k.split(".", 1)[0] + "." for k in manifest.tensors})
        raise HfExportError(
            f"step {step} has no tensors under the prefix {prefix!r}; its tensors start with "
            f"{tops[:10]}: pass prefix= to choose the model's (the Checkpointer uses 'model.')"
        )
    return selected


def _existing_export_files(out: Path) -> list[Path]:
    if not out.is_dir():
        return []
    return sorted(
        p
        for p in out.iterdir()
        if p.name in (SINGLE_FILE, INDEX_FILE, CONFIG_FILE) or _SHARD_RE.fullmatch(p.name)
    )


def _write_durably(path: Path, write: Callable[[Path], object]) -> None:
    """Write through a temp name, fsync, then rename: a crash never leaves a torn file."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _json_doc(config: Any, file_name: str) -> dict[str, Any]:
    """``config`` as a JSON object: an object with ``to_json_string()`` or ``to_dict()``, a
    dict, or the path of ``file_name`` (or of a folder holding one)."""
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if path.is_dir():
            path = path / file_name
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise HfExportError(
                f"cannot read the config {path}: {e}; pass the config object "
                f"(model.config, model.peft_config['default']) or the path of its {file_name}"
            ) from e
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise HfExportError(f"{path} is not JSON ({e}): pass the {file_name}") from e
    elif hasattr(config, "to_json_string"):
        # transformers' PretrainedConfig: the same text its save_pretrained writes
        doc = json.loads(config.to_json_string())
    elif hasattr(config, "to_dict"):
        doc = config.to_dict()
    elif isinstance(config, Mapping):
        doc = dict(config)
    else:
        raise HfExportError(
            f"config of type {type(config).__name__} is not a model config: pass "
            f"model.config (anything with to_dict()), a dict, or the path of a {file_name}"
        )
    if not isinstance(doc, dict):
        raise HfExportError(f"the config must be a JSON object, got {type(doc).__name__}")
    return doc


def _config_json(config: Any) -> str:
    """The text of ``config.json`` for ``config`` (see :func:`export_hf`)."""
    doc = _json_doc(config, CONFIG_FILE)
    if "model_type" not in doc:
        log.warning(
            "the config has no 'model_type': AutoConfig/AutoModel cannot load the export; "
            "pass the model's own config (model.config) to make it loadable by class name"
        )
    try:
        return json.dumps(doc, indent=2, sort_keys=True) + "\n"
    except (TypeError, ValueError) as e:
        raise HfExportError(f"the config cannot be written as JSON: {e}") from e


def export_hf(
    uri: Location,
    out_dir: str | os.PathLike[str],
    step: int | None = None,
    max_shard_size: int | str = "5GB",
    *,
    config: Any = None,
    weights_only: bool = False,
    prefix: str = DEFAULT_PREFIX,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
    merge_adapter: str | None = None,
    adapter_config: Any = None,
) -> ExportInfo:
    """Write the model weights of checkpoint ``step`` (default: the newest complete one) under
    ``uri`` to ``out_dir`` as Hugging Face safetensors.

    Args:
        uri: the checkpoint root (a path, ``file://``, ``s3://`` or a Storage).
        out_dir: a local directory; created if missing. It must not already hold an export
            (``model*.safetensors`` or the index) unless ``overwrite``, which deletes those first.
        step: the step to export; None for the newest complete step.
        max_shard_size: bytes per weight file, an int or ``"5GB"``/``"2GiB"`` (GB = 10**9
            bytes, as in ``huggingface_hub``).
        config: the model's config, written as ``config.json``: a transformers config
            (``model.config``), any object with ``to_dict()``, a dict, or the path of a
            ``config.json`` (or of a folder holding one). Required unless ``weights_only``.
        weights_only: export the weights without a ``config.json`` (for tools that bring
            their own); ``from_pretrained`` cannot load such a folder by itself.
        prefix: the key prefix of the model's tensors in the checkpoint, stripped on export.
        overwrite: replace an existing export in ``out_dir``.
        progress: called with (bytes written, total bytes) after every tensor.
        merge_adapter: for a PEFT checkpoint, the LoRA adapter to merge into the base weights
            (``W + scaling * B @ A``, as PEFT's ``merge_and_unload()``): the export is the
            base model under its own names, ``config`` the base model's config. Plain LoRA on
            linear layers only; DoRA, LoRA biases, embedding/conv adapters, per-module rank or
            alpha patterns and ``modules_to_save`` are refused (export the adapter with
            :func:`export_peft_adapter` and merge with PEFT).
        adapter_config: the adapter's config for ``merge_adapter``, as in
            :func:`export_peft_adapter`; default: the one ``BatonTrainer`` saved.

    Memory: at most one output shard (or one tensor, when a tensor is larger than a shard),
    plus the merged adapter's A and B matrices.
    """
    started = time.perf_counter()
    limit = parse_size(max_shard_size)
    if config is None and not weights_only:
        raise HfExportError(
            "no config given: without config.json, from_pretrained(out_dir) silently builds a "
            "default-shaped model of its class (a 7B one for Llama) instead of yours; pass "
            "config=model.config (or the path of its config.json; CLI: --config), or "
            "weights_only=True (CLI: --weights-only) to export the weights alone"
        )
    if config is not None and weights_only:
        raise HfExportError("config and weights_only=True contradict each other: pass one")
    config_text = _config_json(config) if config is not None else None
    storage = open_storage(uri)  # once: an S3 root gets one client for the whole export
    step, manifest = _manifest_of(storage, step)
    merge = None
    if merge_adapter is not None:
        merge = _LoraMerge.plan(
            storage, manifest, step, prefix=prefix, adapter=merge_adapter, config=adapter_config
        )
        selected = merge.selected
    elif adapter_config is not None:
        raise HfExportError("adapter_config goes with merge_adapter= (or export_peft_adapter)")
    else:
        selected = _select(manifest, prefix, step)
    shards = _plan(selected, limit)
    total = sum(item.nbytes for item in selected)
    if len(shards) == 1:
        filenames = [SINGLE_FILE]
    else:
        filenames = [
            f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
        ]

    out = Path(out_dir)
    existing = _existing_export_files(out)
    if existing and not overwrite:
        raise HfExportError(
            f"{out} already holds an export ({', '.join(p.name for p in existing[:3])}...): "
            "choose an empty directory, or pass overwrite=True (--overwrite) to replace it"
        )
    out.mkdir(parents=True, exist_ok=True)
    for old in existing:
        old.unlink()

    try:
        _stream_shards(
            storage,
            step,
            out=out,
            shards=shards,
            filenames=filenames,
            total=total,
            progress=progress,
            transform=merge.apply if merge is not None else None,
        )
        if len(shards) > 1:
            shard_of = {item.key: i for i, shard in enumerate(shards) for item in shard}
            index_doc = {
                "metadata": {"total_size": total},
                "weight_map": {item.name: filenames[shard_of[item.key]] for item in selected},
            }
            _write_durably(
                out / INDEX_FILE,
                lambda p: p.write_text(json.dumps(index_doc, indent=2, sort_keys=True) + "\n"),
            )
        if config_text is not None:
            text = config_text
            _write_durably(out / CONFIG_FILE, lambda p: p.write_text(text, encoding="utf-8"))
    except BaseException:
        # No half export: a reader that finds some shards but not the rest would load a model
        # with missing weights, or fail far from the cause.
        for name in (*filenames, INDEX_FILE, CONFIG_FILE):
            (out / name).unlink(missing_ok=True)
        raise
    return ExportInfo(
        step=step,
        out_dir=str(out),
        files=tuple(filenames),
        tensors=len(selected),
        total_size=total,
        config=str(out / CONFIG_FILE) if config_text is not None else None,
        seconds=time.perf_counter() - started,
    )


def export_peft_adapter(
    uri: Location,
    out_dir: str | os.PathLike[str],
    step: int | None = None,
    *,
    adapter_config: Any = None,
    adapter_name: str = "default",
    prefix: str = DEFAULT_PREFIX,
    overwrite: bool = False,
) -> ExportInfo:
    """Write the PEFT (LoRA) adapter ``adapter_name`` of checkpoint ``step`` under ``uri`` to
    ``out_dir`` as ``adapter_model.safetensors`` + ``adapter_config.json``, the layout that
    ``peft.PeftModel.from_pretrained(base_model, out_dir)`` loads.

    Args:
        adapter_config: the adapter's config: ``model.peft_config["default"]`` (any object
            with ``to_dict()``), a dict, or the path of an ``adapter_config.json`` (or of a
            folder holding one). Default: the config ``BatonTrainer`` saved in the step
            (:data:`PEFT_CONFIG_KEY`); a step without one is refused, asking for it.
        adapter_name: the adapter to export (PEFT's default adapter is ``"default"``).
        The rest as in :func:`export_hf`. The adapter is written as one file (adapters are
        small; it is held in memory once).
    """
    started = time.perf_counter()
    given = _json_doc(adapter_config, ADAPTER_CONFIG_FILE) if adapter_config is not None else None
    storage = open_storage(uri)
    step, manifest = _manifest_of(storage, step)
    segment = f".{adapter_name}"
    selected = [
        _Planned(key=item.key, name=_peft_name(item.name, segment), nbytes=item.nbytes)
        for item in _select(manifest, prefix, step)
        if _ADAPTER_MARK in item.name
        and (segment + "." in item.name or item.name.endswith(segment))
    ]
    if not selected:
        names = sorted({m.group(1) for k in manifest.tensors for m in [_ADAPTER_RE.search(k)] if m})
        raise HfExportError(
            f"step {step} holds no tensor of a PEFT adapter named {adapter_name!r} under "
            f"{prefix!r} (adapters found: {names or 'none'}): export the model with export_hf, "
            "or pass adapter_name= (CLI: --adapter NAME) of one of the adapters found"
        )
    doc = given if given is not None else _saved_peft_config(storage, step, adapter_name)
    beyond = _beyond_lora_matrices(doc)
    if beyond:
        raise HfExportError(
            f"the adapter {adapter_name!r} also trains {beyond}, which PEFT saves beside the "
            "LoRA matrices and this export does not write (the adapter would load without "
            "them): load the step into the PeftModel (Checkpointer.restore, or api.load) and "
            "call model.save_pretrained(out_dir)"
        )
    # as PeftModel.save_pretrained writes it (from_pretrained sets it again from is_trainable)
    doc = {**doc, "inference_mode": True}
    out = Path(out_dir)
    existing = [p for p in (out / ADAPTER_FILE, out / ADAPTER_CONFIG_FILE) if p.exists()]
    if existing and not overwrite:
        raise HfExportError(
            f"{out} already holds an adapter export ({existing[0].name}): choose an empty "
            "directory, or pass overwrite=True (--overwrite) to replace it"
        )
    out.mkdir(parents=True, exist_ok=True)
    name_of = {item.key: item.name for item in selected}
    tensors = {name_of[k]: t for k, t in api.iter_tensors(storage, step=step, keys=name_of)}
    try:
        _write_shard(out / ADAPTER_FILE, tensors)
        text = json.dumps(doc, indent=2, sort_keys=True, default=_jsonable) + "\n"
        _write_durably(out / ADAPTER_CONFIG_FILE, lambda p: p.write_text(text, encoding="utf-8"))
    except BaseException:
        for name in (ADAPTER_FILE, ADAPTER_CONFIG_FILE):
            (out / name).unlink(missing_ok=True)
        raise
    return ExportInfo(
        step=step,
        out_dir=str(out),
        files=(ADAPTER_FILE,),
        tensors=len(selected),
        total_size=sum(item.nbytes for item in selected),
        config=str(out / ADAPTER_CONFIG_FILE),
        seconds=time.perf_counter() - started,
    )


_ADAPTER_RE: Final = re.compile(r"\.lora_[A-Za-z_]+\.([^.]+)(?:\.|$)")


def _peft_name(name: str, segment: str) -> str:
    """PEFT's saved name of a live adapter tensor, as ``get_peft_model_state_dict`` makes it
    (the adapter name removed before the last part, and LoRA's DoRA rename):
    ``q_proj.lora_A.default.weight`` -> ``q_proj.lora_A.weight``, ``lora_embedding_A.default``
    -> ``lora_embedding_A``, ``lora_magnitude_vector.default.weight`` ->
    ``lora_magnitude_vector``."""
    if name.endswith(segment):
        return name[: -len(segment)]
    key, _, suffix = name.rpartition(".")
    saved = f"{key.removesuffix(segment)}.{suffix}"
    return saved.removesuffix(".weight") if saved.endswith(_DORA_MAGNITUDE) else saved


_DORA_MAGNITUDE: Final = "lora_magnitude_vector.weight"
"""A DoRA layer's magnitude; PEFT saves it as ``...lora_magnitude_vector`` (no ``.weight``),
the name it had before DoRA became a module."""


def _beyond_lora_matrices(doc: Mapping[str, Any]) -> list[str]:
    """The settings of a LoRA config under which PEFT's adapter holds more than the tensors
    named ``lora_``: whole modules (``modules_to_save``), biases, token deltas."""
    found = [k for k in ("modules_to_save", "trainable_token_indices") if doc.get(k)]
    if doc.get("bias", "none") != "none":
        found.append(f"bias={doc['bias']!r}")
    return found


def _jsonable(value: Any) -> Any:
    """PEFT configs hold sets (``target_modules``) and enums; JSON has lists and strings."""
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if hasattr(value, "value"):
        return value.value
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def peft_config_doc(config: Any) -> dict[str, Any]:
    """A PEFT adapter config (``model.peft_config[name]``, a dict, or an
    ``adapter_config.json``) as the JSON object its ``adapter_config.json`` holds."""
    doc = _json_doc(config, ADAPTER_CONFIG_FILE)
    try:
        parsed = json.loads(json.dumps(doc, default=_jsonable))
    except (TypeError, ValueError) as e:
        raise HfExportError(f"the adapter config cannot be written as JSON: {e}") from e
    assert isinstance(parsed, dict)
    return parsed


def _saved_peft_config(storage: Storage, step: int, adapter_name: str) -> dict[str, Any]:
    """The config of ``adapter_name`` that ``BatonTrainer`` recorded in ``step``."""
    node: Any = api.read_tree(storage, step)
    for part in _PEFT_CONFIG_PATH:
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, dict) or not node:
        raise HfExportError(
            f"step {step} holds no PEFT config (BatonTrainer records model.peft_config in "
            "every save of a PEFT model; a plain Checkpointer or an older Baton does not): "
            f"pass adapter_config=model.peft_config[{adapter_name!r}] or the path of its "
            "adapter_config.json (CLI: --config with --adapter, --adapter-config with "
            "--merge-adapter)"
        )
    found = node.get(adapter_name)
    if not isinstance(found, dict):
        raise HfExportError(
            f"step {step} holds the PEFT config of the adapters {sorted(node)}, not of "
            f"{adapter_name!r}: pass adapter_name= (CLI: --adapter NAME) of one of those"
        )
    return found


@dataclass(frozen=True, slots=True)
class _LoraMerge:
    """What ``export_hf(merge_adapter=...)`` writes: the base tensors under the base model's
    names, and the LoRA matrices to add to some of them."""

    selected: list[_Planned]
    lora: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """Checkpoint key of a base weight -> that layer's (A, B)."""
    scaling: float
    fan_in_fan_out: bool

    @staticmethod
    def plan(
        storage: Storage, manifest: Any, step: int, *, prefix: str, adapter: str, config: Any
    ) -> _LoraMerge:
        doc = (
            _json_doc(config, ADAPTER_CONFIG_FILE)
            if config is not None
            else _saved_peft_config(storage, step, adapter)
        )
        unsupported = [
            k
            for k in ("use_dora", "lora_bias", "rank_pattern", "alpha_pattern", "modules_to_save")
            if doc.get(k)
        ]
        if doc.get("peft_type") != "LORA" or unsupported:
            raise HfExportError(
                f"the adapter {adapter!r} is {doc.get('peft_type')!r}"
                + (f" with {unsupported}" if unsupported else "")
                + ": merge_adapter merges plain LoRA only; export the adapter with "
                "export_peft_adapter (CLI: --adapter) and merge it with PEFT's merge_and_unload()"
            )
        r, alpha = doc["r"], doc["lora_alpha"]
        # PEFT's LoraLayer.update_layer
        scaling = alpha / math.sqrt(r) if doc.get("use_rslora") else alpha / r
        pairs: dict[str, dict[str, str]] = {}
        kept: list[_Planned] = []
        for item in _select(manifest, prefix, step):
            m = _LORA_AB_RE.fullmatch(item.name)
            if m is not None:
                if m.group(3) == adapter:
                    pairs.setdefault(m.group(1), {})[m.group(2)] = item.key
                continue  # another adapter's matrices are not part of the merged model
            other = _ADAPTER_RE.search(item.name)
            if other is not None and other.group(1) != adapter:
                continue
            if other is not None or ".modules_to_save." in item.name:
                raise HfExportError(
                    f"{item.key!r} is not a LoRA A/B matrix of a linear layer: merge_adapter "
                    "cannot merge it; export the adapter with export_peft_adapter (CLI: "
                    "--adapter) and merge it with PEFT's merge_and_unload()"
                )
            name = item.name.removeprefix(_PEFT_ROOT).replace(".base_layer.", ".")
            kept.append(_Planned(key=item.key, name=name, nbytes=item.nbytes))
        if not pairs:
            raise HfExportError(
                f"step {step} holds no LoRA matrices of an adapter named {adapter!r} under "
                f"{prefix!r}: export it with export_hf without merge_adapter"
            )
        base_key = {m: f"{prefix}{m}.base_layer.weight" for m in pairs}
        lacking = [m for m, ab in pairs.items() if set(ab) != {"A", "B"}]
        lacking += [m for m in pairs if base_key[m] not in manifest.tensors]
        if lacking:
            raise HfExportError(
                f"LoRA layers without their A, B and base_layer.weight: {lacking[:3]}: the "
                "step is not a PEFT LoRA model's state dict; export it without merge_adapter"
            )
        names = [item.name for item in kept]
        if len(set(names)) != len(names):
            raise HfExportError("the merged names collide: the step holds more than one model")
        wanted = {k for ab in pairs.values() for k in ab.values()}
        read = dict(api.iter_tensors(storage, step=step, keys=wanted))
        return _LoraMerge(
            selected=kept,
            lora={base_key[m]: (read[ab["A"]], read[ab["B"]]) for m, ab in pairs.items()},
            scaling=scaling,
            fan_in_fan_out=bool(doc.get("fan_in_fan_out")),
        )

    def apply(self, key: str, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` merged as PEFT's LoRA ``Linear.get_delta_weight`` and ``merge()`` do it,
        operation for operation (fp16/bf16 in float32, as PEFT does on the CPU)."""
        ab = self.lora.get(key)
        if ab is None:
            return weight
        a, b = ab
        cast = b.dtype in (torch.float16, torch.bfloat16)
        delta = b.float() @ a.float() if cast else b @ a
        if self.fan_in_fan_out:
            delta = delta.T
        delta = delta * self.scaling
        if cast:
            delta = delta.to(b.dtype)
        return (weight + delta).to(weight.dtype)  # PEFT adds in place: weight.data += delta


def _stream_shards(
    storage: Storage,
    step: int,
    *,
    out: Path,
    shards: list[list[_Planned]],
    filenames: list[str],
    total: int,
    progress: Callable[[int, int], None] | None,
    transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> None:
    # The reader yields tensors in manifest order, which is the order the plan was cut in, so
    # shards fill one after another and only the one being filled is held.
    shard_of = {item.key: i for i, shard in enumerate(shards) for item in shard}
    name_of = {item.key: item.name for shard in shards for item in shard}
    pending: dict[str, torch.Tensor] = {}
    current = 0
    done = 0
    for key, tensor in api.iter_tensors(storage, step=step, keys=shard_of.keys()):
        index = shard_of[key]
        # api.iter_tensors yields each selected tensor once, in manifest order
        assert index == current, f"{key!r} came out of manifest order"
        pending[name_of[key]] = transform(key, tensor) if transform is not None else tensor
        done += tensor.numel() * tensor.element_size()
        if len(pending) == len(shards[current]):
            _write_shard(out / filenames[current], pending)
            pending = {}
            current += 1
        if progress is not None:
            progress(done, total)
    assert current == len(shards), f"wrote {current} of {len(shards)} files"


def _write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    _write_durably(path, lambda p: save_file(tensors, str(p), metadata=dict(_METADATA)))


# ------------------------------------------------------------------------------- CLI


def run_export_hf(args: argparse.Namespace) -> int:
    """Run ``python -m trainer_sdk export-hf`` (``cli.py`` parses the arguments).

    Prints progress to stderr and a summary to stdout; returns the exit code.
    """
    size: int | str = args.max_shard_size
    if isinstance(size, str) and size.strip().isdigit():
        size = int(size)
    progress = Progress(sys.stderr)

    def report(done: int, total: int) -> None:
        pct = 100.0 * done / total if total else 100.0
        progress.update(f"export-hf: {done / 2**20:.1f} / {total / 2**20:.1f} MiB ({pct:.0f}%)")

    try:
        if args.adapter is not None:
            info = export_peft_adapter(
                args.uri,
                args.out,
                step=args.step,
                adapter_config=args.config,
                adapter_name=args.adapter,
                prefix=args.prefix,
                overwrite=args.overwrite,
            )
            print(
                f"exported the adapter {args.adapter!r} of step {info.step}: {info.tensors} "
                f"tensors, {info.total_size} bytes, {ADAPTER_FILE} and {ADAPTER_CONFIG_FILE} "
                f"in {info.out_dir} ({info.seconds:.1f}s)"
            )
            return 0
        info = export_hf(
            args.uri,
            args.out,
            step=args.step,
            max_shard_size=size,
            config=args.config,
            weights_only=args.weights_only,
            prefix=args.prefix,
            overwrite=args.overwrite,
            progress=report,
            merge_adapter=args.merge_adapter,
            adapter_config=args.adapter_config,
        )
    except BatonError as e:
        progress.done()
        print(f"export-hf: error: {e}", file=sys.stderr)
        return 1
    progress.done()
    print(
        f"exported step {info.step}: {info.tensors} tensors, {info.total_size} bytes, "
        f"{len(info.files)} file(s)"
        + (f", adapter {args.merge_adapter!r} merged" if args.merge_adapter else "")
        + (" and config.json" if info.config else " (weights only, no config.json)")
        + f" in {info.out_dir} ({info.seconds:.1f}s)"
    )
    return 0
