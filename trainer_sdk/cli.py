"""``python -m trainer_sdk`` (also ``baton-ckpt``): look at and check checkpoints.

    python -m trainer_sdk ls URI                  steps, complete or not, and the latest hint
    python -m trainer_sdk inspect URI [--step N]  one manifest in human form
    python -m trainer_sdk verify URI [--step N]   every file's size and digest (progress on
                                                  stderr); exit status 1 on any corruption
    python -m trainer_sdk export-hf URI OUT (--config PATH | --weights-only) [--step N]
                                  [--max-shard-size 5GB] [--prefix P] [--overwrite]
                                  [--merge-adapter [NAME] [--adapter-config PATH]]
    python -m trainer_sdk export-hf URI OUT --adapter [NAME] [--config PATH] [--step N] ...
                                  (a PEFT adapter alone, in PEFT's layout)

``ls``, ``inspect`` and ``verify`` do not import torch, so they start fast on any machine that
can reach the storage. Exit status: 0 fine, 1 corrupt or incomplete, 2 usage or nothing found,
141 when the reader of the output went away (``| head``), as for a process killed by SIGPIPE.

Progress goes to stderr: redrawn in place on a terminal, as a plain line now and then in a log.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import TextIO

from trainer_sdk.errors import BatonError, CheckpointError
from trainer_sdk.format import _catalog
from trainer_sdk.format.layout import (
    Manifest,
    check_header_matches,
    header_length,
    new_hasher,
    parse_safetensors_header,
    step_dir,
)
from trainer_sdk.saveload._progress import Progress
from trainer_sdk.storage import Storage, open_storage

__all__ = ["main"]

_CHUNK = 8 * 1024 * 1024
_EXIT_PIPE = 128 + 13  # what a shell reports for a process killed by SIGPIPE


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _pick_step(storage: Storage, step: int | None) -> int:
    if step is not None:
        return step
    newest = _catalog.newest_complete(storage)
    if newest is None:
        raise LookupError(f"no complete checkpoint under {storage.uri}")
    return newest


def _refs(m: Manifest) -> list[str]:
    return [m.path_of(k) for k, f in m.files.items() if f.step is not None]


def cmd_ls(storage: Storage, out: TextIO) -> int:
    steps = _catalog.step_dirs(storage)
    if not steps:
        print(f"no step directories under {storage.uri}", file=out)
        return 2
    print(f"{'STEP':>12}  {'STATUS':<10} {'WORLD':>5}  {'TRIGGER':<9} {'SIZE':>10}  TIME", file=out)
    newest = None
    rows: list[tuple[int, Manifest | CheckpointError]] = []
    for s in steps:
        try:
            rows.append((s, _catalog.read_manifest(storage, s)))
        except CheckpointError as e:
            rows.append((s, e))
    # A directory without a manifest whose shards complete steps reference (format v3): a
    # deleted step, kept for what later steps reuse, not a crashed save.
    referenced = {int(p[5:17]) for _, m in rows if isinstance(m, Manifest) for p in _refs(m)}
    for s, m in rows:
        if isinstance(m, CheckpointError):
            status = "invalid" if "never committed" not in str(m) else "incomplete"
            if status == "incomplete" and s in referenced:
                status = "reused"
            print(f"{s:>12}  {status:<10} {'-':>5}  {'-':<9} {'-':>10}  -", file=out)
            continue
        newest = s
        print(
            f"{s:>12}  {'complete':<10} {m.world_size:>5}  {m.trigger:<9} "
            f"{_human(m.total_bytes):>10}  {m.time}",
            file=out,
        )
    hint = _catalog.latest_hint(storage)
    agrees = "agrees" if hint == newest else f"stale: the newest complete step is {newest}"
    print(f"latest: {hint if hint is not None else '(none)'} ({agrees})", file=out)
    return 0


def cmd_inspect(storage: Storage, step: int | None, out: TextIO) -> int:
    s = _pick_step(storage, step)
    m = _catalog.read_manifest(storage, s)
    print(f"checkpoint  {storage.uri}/{step_dir(s)}", file=out)
    print(f"step        {m.step}", file=out)
    print(f"world size  {m.world_size}", file=out)
    print(f"trigger     {m.trigger}", file=out)
    print(f"time        {m.time}", file=out)
    print(f"format      v{m.version} (torch {m.torch_version}, baton {m.baton_version})", file=out)
    own = sum(1 for f in m.files.values() if f.step is None)
    print(f"size        {_human(m.total_bytes)} in {own} files", file=out)
    if m.referenced_steps():
        steps = ", ".join(map(str, sorted(m.referenced_steps())))
        print(
            f"reuses      {_human(m.referenced_bytes)} in {len(m.files) - own} files of "
            f"step(s) {steps} (references: written once, not again by this step)",
            file=out,
        )
    print("\nfiles:", file=out)
    for name, f in m.files.items():
        algorithm, digest = f.digest
        ref = "  (reused)" if f.step is not None else ""
        print(f"  {name:<36} {_human(f.size):>10}  {algorithm} {digest[:16]}…{ref}", file=out)
    print(f"\ntensors ({len(m.tensors)}):", file=out)
    # Keys are "<top-level key>.<the object's own key>" ("model." + "model.layers.0..." for a
    # transformers model): show each top-level prefix once, as a heading, and the keys under
    # it as the object names them, so that export-hf's --prefix is the heading.
    # Keys without a dot are listed first, as they are.
    groups: dict[str, list[str]] = {}
    for key in m.tensors:
        top, sep, _ = key.partition(".")
        groups.setdefault(top + sep if sep else "", []).append(key)
    kw = max((len(k) - len(p) for p, keys in groups.items() for k in keys), default=10)
    for prefix in sorted(groups, key=bool):  # "" (no heading) first, then checkpoint order
        keys = groups[prefix]
        indent = "  "
        if prefix:
            size = sum(p.nbytes for k in keys for p in m.tensors[k].pieces)
            print(f"  {prefix}  ({len(keys)} tensors, {_human(size)})", file=out)
            indent = "    "
        for key in keys:
            t = m.tensors[key]
            nbytes = sum(p.nbytes for p in t.pieces)
            shape = "x".join(map(str, t.shape)) or "scalar"
            print(
                f"{indent}{key[len(prefix) :]:<{kw}}  {t.kind:<10} {t.dtype:<5} {shape:<16} "
                f"{len(t.pieces):>3} piece(s) {_human(nbytes):>10}",
                file=out,
            )
    return 0


def _verify_step(storage: Storage, m: Manifest, err: TextIO) -> list[str]:
    problems: list[str] = []
    total = sum(f.size for f in m.files.values())
    done = 0
    t0 = time.monotonic()
    progress = Progress(err)
    buf = bytearray(_CHUNK)
    for i, (name, f) in enumerate(m.files.items(), 1):
        path = m.path_of(name)  # a reference (v3) is checked in the step that holds it
        try:
            size = storage.size(path)
        except FileNotFoundError:
            problems.append(f"{path}: missing")
            continue
        except BatonError as e:
            problems.append(str(e))
            continue
        if size != f.size:
            problems.append(f"{path}: {size} bytes, the manifest says {f.size} (truncated?)")
            continue
        algorithm, want = f.digest
        h = new_hasher(algorithm)
        head = b""
        for off in range(0, size, _CHUNK):
            n = min(_CHUNK, size - off)
            view = memoryview(buf)[:n]
            storage.read_into(path, off, view)
            h.update(view)
            if off == 0:
                head = bytes(view)
            done += n
            rate = done / max(time.monotonic() - t0, 1e-6)
            progress.update(
                f"verifying {i}/{len(m.files)} files, {_human(done)} of {_human(total)} "
                f"({_human(rate)}/s)"
            )
        if h.hexdigest() != want:
            problems.append(f"{path}: {algorithm} {h.hexdigest()} differs from the manifest's")
            continue
        if f.data_start is not None:
            try:
                n = header_length(head[:8], size, path=path)
                if 8 + n > len(head):
                    head = storage.read_bytes(path)[: 8 + n]
                header = parse_safetensors_header(head, size, path=path)
                pieces = [p for t in m.tensors.values() for p in t.pieces if p.file == name]
                check_header_matches(header, pieces, f, path=path)
            except BatonError as e:
                problems.append(str(e))
    progress.done()
    return problems


def cmd_verify(storage: Storage, step: int | None, out: TextIO, err: TextIO) -> int:
    s = _pick_step(storage, step)
    try:
        m = _catalog.read_manifest(storage, s)
    except CheckpointError as e:
        print(f"FAILED step {s}: {e}", file=out)
        return 1
    problems = _verify_step(storage, m, err)
    if problems:
        print(f"FAILED step {s}: {len(problems)} problem(s)", file=out)
        for p in problems:
            print(f"  {p}", file=out)
        return 1
    print(
        f"OK step {s}: {len(m.files)} files, {_human(m.total_bytes + m.referenced_bytes)}, "
        "every digest matches",
        file=out,
    )
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer_sdk", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("ls", help="list steps and whether they are complete")
    ls.add_argument("uri")
    for name, text in (("inspect", "show a manifest"), ("verify", "check every file's digest")):
        sp = sub.add_parser(name, help=text)
        sp.add_argument("uri")
        sp.add_argument("--step", type=int, default=None, help="default: newest complete step")
    # Defined here, not in hf.py, so that building the parser never imports torch.
    ex = sub.add_parser(
        "export-hf",
        help="write a checkpoint's model weights as Hugging Face safetensors",
        description=(
            "Consolidate the model weights of a checkpoint (any world size) into "
            "model.safetensors, or model-0000i-of-0000N.safetensors shards plus "
            "model.safetensors.index.json, with the model's config.json."
        ),
    )
    ex.add_argument("uri", help="checkpoint root: a path, file:// or s3://")
    ex.add_argument("out", help="output directory (created if missing)")
    ex.add_argument("--step", type=int, default=None, help="step (default: newest complete)")
    ex.add_argument(
        "--max-shard-size", default="5GB", help="bytes per file: '5GB', '2GiB', or an int"
    )
    ex.add_argument(
        "--prefix", default="model.", help="key prefix of the model's tensors (stripped)"
    )
    ex.add_argument("--overwrite", action="store_true", help="replace an existing export")
    ex.add_argument(
        "--adapter",
        metavar="NAME",
        nargs="?",
        const="default",
        help=(
            "export the PEFT (LoRA) adapter NAME (default: 'default') alone, as "
            "adapter_model.safetensors + adapter_config.json; its config is the one "
            "BatonTrainer saved in the checkpoint, or --config (the adapter's "
            "adapter_config.json or its folder)"
        ),
    )
    ex.add_argument(
        "--merge-adapter",
        metavar="NAME",
        nargs="?",
        const="default",
        help=(
            "export the base model with the LoRA adapter NAME (default: 'default') merged into "
            "its weights, under the base model's names, as PEFT's merge_and_unload() gives; "
            "--config is the base model's config.json"
        ),
    )
    ex.add_argument(
        "--adapter-config",
        metavar="PATH",
        help=(
            "with --merge-adapter: the adapter's adapter_config.json (or its folder), for a "
            "checkpoint that holds no PEFT config"
        ),
    )
    # Not required=True: an --adapter export needs neither (main() checks the others).
    what = ex.add_mutually_exclusive_group()
    what.add_argument(
        "--config",
        help="the model's config.json (or a folder holding one), written beside the weights",
    )
    what.add_argument(
        "--weights-only",
        action="store_true",
        help="write no config.json (from_pretrained cannot load the folder by itself)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.cmd == "export-hf":
        _check_export_args(parser, args)
    try:
        code = _run(args)
        sys.stdout.flush()  # inside the try: a closed pipe fails here, not at exit
    except BrokenPipeError:
        # The reader went away (`... | head`): stop quietly. Point stdout at /dev/null so
        # that the interpreter's own flush at exit cannot raise a second time.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return _EXIT_PIPE
    return code


def _check_export_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors of ``export-hf`` that argparse's groups cannot say (exit status 2)."""
    if args.adapter is not None:
        if args.merge_adapter is not None or args.weights_only or args.adapter_config:
            parser.error(
                "--adapter exports the adapter alone: drop --merge-adapter, --weights-only "
                "and --adapter-config (--config names the adapter's adapter_config.json)"
            )
        return
    if args.config is None and not args.weights_only:
        parser.error(
            "export-hf needs --config PATH (the model's config.json) or --weights-only; "
            "--adapter exports a PEFT adapter alone, with its config from the checkpoint"
        )
    if args.adapter_config is not None and args.merge_adapter is None:
        parser.error("--adapter-config goes with --merge-adapter (or use --adapter --config)")


def _run(args: argparse.Namespace) -> int:
    out, err = sys.stdout, sys.stderr
    try:
        if args.cmd == "export-hf":
            from trainer_sdk import hf  # torch only for this sub-command

            return hf.run_export_hf(args)
        storage = open_storage(args.uri)
        if args.cmd == "ls":
            return cmd_ls(storage, out)
        if args.cmd == "inspect":
            return cmd_inspect(storage, args.step, out)
        return cmd_verify(storage, args.step, out, err)
    except LookupError as e:
        print(f"error: {e}", file=err)
        return 2
    except BatonError as e:
        print(f"error: {e}", file=err)
        return 1
