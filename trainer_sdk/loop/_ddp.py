"""DDP's gradient bucket layout: saved with a checkpoint, put back on resume, for exact sums.

Why this exists: ``DistributedDataParallel`` reduces its *first* iteration after construction
with an initial bucket layout (every parameter in index order), records the order in which
gradients become ready, and then rebuilds its buckets once in that order (the
``rebuilt_per_bucket_param_indices`` of its logging data). Where an element sits in a bucket
decides which rank's partial sum it starts from in a ring all-reduce, so with three or more
ranks the same gradients summed under the two layouts can differ in the last bit. A run that
never stops reduces step 1 with the initial layout and every later step with the rebuilt one;
a resumed run would reduce its first step after the resume with the initial layout again, and
drift from there. Two ranks never show it: ``a + b == b + a``.

So the Checkpointer saves the rebuilt layout (a list of buckets, each a list of parameter
indices) in the checkpoint's ``baton`` metadata, and on resume builds the DDP reducer again
with that layout *before* the first step. The new reducer still rebuilds after its first
iteration, from the same gradient-ready order, so it arrives at the same layout and keeps it.

Who calls what (``trainer_sdk.checkpointer``, every rank, training thread):

* :func:`bucket_layout` while preparing a save (it may run DDP's pending rebuild early: a
  collective on DDP's process group, which every rank reaches at the same step);
* :func:`apply_bucket_layout` after the model state is loaded, before training resumes.

This relies on DDP internals of torch 2.x (``_ddp_init_helper``, ``_get_ddp_logging_data``);
:func:`apply_bucket_layout` checks what it built and raises :class:`BucketLayoutError`, naming
what to set, instead of training on with a layout that would silently break exactness.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainer_sdk.errors import CheckpointError

__all__ = ["BucketLayoutError", "apply_bucket_layout", "bucket_layout", "parse_layout"]

log = logging.getLogger("trainer_sdk.ddp")


class BucketLayoutError(CheckpointError):
    """DDP's bucket layout could not be read or put back (exactness would be lost)."""


def _ddp(model: Any) -> Any:
    """``model`` if it is a DDP module, else ``None`` (typed ``Any``: the DDP internals used
    here are untyped)."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper around a DDP module
    return model if isinstance(model, DistributedDataParallel) else None


def _rebuilds(ddp: Any) -> bool:
    """Whether this DDP ever changes its layout after the first iteration (see the module doc).

    With ``find_unused_parameters=True`` (and no static graph) the C++ reducer never rebuilds,
    so its one layout serves every step of every run and there is nothing to save.
    """
    return bool(ddp.static_graph or not ddp.find_unused_parameters)


def parse_layout(text: str) -> list[list[int]]:
    """``'5 4 3 2, 1 0'`` (DDP's logging format) as ``[[5, 4, 3, 2], [1, 0]]``."""
    return [[int(i) for i in bucket.split()] for bucket in text.split(",") if bucket.strip()]


def bucket_layout(model: Any) -> list[list[int]] | None:
    """The steady-state bucket layout of ``model`` if it is a DDP model that has one.

    ``None`` when the model is not DDP, when DDP never rebuilds its buckets, or when no
    iteration has run yet (a resume from here starts with the initial layout, exactly as the
    uninterrupted run's first iteration did).
    """
    ddp = _ddp(model)
    if ddp is None or getattr(ddp, "_delay_all_reduce_all_params", False) or not _rebuilds(ddp):
        return None
    # After the first backward the rebuild is pending until the next forward; run it now so
    # that a checkpoint of step 1 already carries the layout that step 2 will use.
    if torch.is_grad_enabled() and ddp.reducer._rebuild_buckets():
        ddp._has_rebuilt_buckets = True
    if not ddp._has_rebuilt_buckets:
        return None
    text = ddp._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices")
    if not text:
        # The logger copies the rebuilt layout at its next sampled iteration (every one of
        # the first ten); a save right after the rebuild comes before that copy.
        ddp.logger.set_runtime_stats_and_log()
        text = ddp._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices")
    if not isinstance(text, str) or not text:
        raise BucketLayoutError(
            "DDP rebuilt its gradient buckets but does not report their layout "
            "(rebuilt_per_bucket_param_indices), so a resume could not be bitwise exact at 3+ "
            "ranks: construct DDP with find_unused_parameters=True (it then never rebuilds), or "
            "report this torch version to Baton"
        )
    layout = parse_layout(text)
    _check_indices(layout, len(ddp._build_params_for_reducer()[0]))
    return layout


def apply_bucket_layout(model: Any, layout: Sequence[Sequence[int]]) -> None:
    """Build ``model``'s DDP reducer again with ``layout`` (before the first step after a resume).

    Comm hooks registered with ``register_comm_hook``, a static graph and mixed precision are
    carried over to the new reducer.
    """
    ddp = _ddp(model)
    if ddp is None or not layout or not _rebuilds(ddp):
        return
    if getattr(ddp, "_use_python_reducer", False) or getattr(
        ddp, "_delay_all_reduce_all_params", False
    ):
        log.warning("DDP runs without its C++ reducer here: its bucket layout is left as it is")
        return
    if ddp._get_ddp_logging_data().get("comm_hook") and not ddp._comm_hooks:
        raise BucketLayoutError(
            "this DDP model has a built-in comm hook, which cannot be moved to a rebuilt "
            "reducer: register the hook after Checkpointer.restore(), or use "
            "register_comm_hook with the hook's Python function"
        )
    params, expect_sparse = ddp._build_params_for_reducer()
    buckets = [list(map(int, b)) for b in layout]
    _check_indices(buckets, len(params))
    if getattr(ddp, "_has_rebuilt_buckets", False):
        current = bucket_layout(ddp)
        if current == buckets:
            return
    cap = int(ddp.bucket_bytes_cap)
    first = int(getattr(getattr(ddp, "_bucket_config", None), "first_bucket_bytes_cap", cap))
    limits = [first] + [cap] * (len(buckets) - 1)
    mapping = ddp._build_debug_param_to_name_mapping(params)
    ddp._remove_autograd_hooks()
    with _fixed_assignment(buckets, limits):
        ddp._ddp_init_helper(params, expect_sparse, mapping, ddp.static_graph)
    ddp._has_rebuilt_buckets = False
    for hook, state in ddp._comm_hooks:
        dist._register_comm_hook(ddp.reducer, state, hook)  # type: ignore[attr-defined]
    if ddp.mixed_precision is not None:
        ddp.reducer._set_mixed_precision_param_dtype(ddp.mixed_precision.param_dtype)
    if ddp.static_graph:
        ddp._static_graph_delay_allreduce_enqueued = False
        ddp.reducer._set_static_graph()
        ddp.logger._set_static_graph()
    sizes = ddp._get_ddp_logging_data().get("bucket_sizes")
    expected = ", ".join(
        str(sum(params[i].numel() * params[i].element_size() for i in b)) for b in buckets
    )
    if sizes != expected:
        raise BucketLayoutError(
            f"DDP's reducer was rebuilt with buckets of {sizes} bytes, not the saved {expected}: "
            "this torch version builds DDP differently, so the resume would not be bitwise "
            "exact at 3+ ranks; construct DDP with find_unused_parameters=True (it then never "
            "changes its layout), or report this torch version to Baton"
        )
    log.info("DDP gradient buckets restored to the saved layout %s", buckets)


@contextmanager
def _fixed_assignment(buckets: list[list[int]], limits: list[int]) -> Iterator[None]:
    """Make DDP's bucket assignment return ``buckets`` while its reducer is built.

    ``_ddp_init_helper`` reverses the assignment it gets (it expects index order and wants
    ready order), so this hands it the reverse.
    """
    original = dist._compute_bucket_assignment_by_size  # type: ignore[attr-defined]

    def assign(*args: Any, **kwargs: Any) -> tuple[list[list[int]], list[int]]:
        return [list(b) for b in reversed(buckets)], list(reversed(limits))

    dist._compute_bucket_assignment_by_size = assign  # type: ignore[attr-defined]
    try:
        yield
    finally:
        dist._compute_bucket_assignment_by_size = original  # type: ignore[attr-defined]


def _check_indices(buckets: list[list[int]], count: int) -> None:
    flat = sorted(i for b in buckets for i in b)
    if flat != list(range(count)):
        raise BucketLayoutError(
            f"the saved DDP bucket layout {buckets} does not cover this model's {count} "
            "trainable parameters exactly once: the model differs from the one that was saved "
            "(build the same model, with the same parameters requiring grad)"
        )
