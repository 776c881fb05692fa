"""A DataLoader sampler that resumes mid-epoch at the exact sample, even on another world size.

Three pitfalls make a resumed run's data order differ from an uninterrupted run's, and this
module makes each impossible:

* **Skipping draws random numbers.** Resuming by iterating over (and discarding) the batches
  already seen runs the dataset's augmentations and advances the RNG (transformers#46628).
  Here the order of an epoch is a pure function of ``(seed, epoch)``, computed with a
  ``torch.Generator`` created for that epoch; resuming starts at a position in it. No global
  RNG is ever read or advanced, and skipped samples are never fetched.
* **Saved state runs ahead of the loop.** ``RandomSampler`` draws the next permutation as soon
  as iteration starts (accelerate#4233), and a DataLoader with workers pulls indices batches
  ahead of the training loop. The state here holds no generator at all, and the position it
  saves is what the *loop* consumed: counted at the consumer by :meth:`ResumableSampler.track`
  (or :meth:`~ResumableSampler.mark_consumed`); without either, the exact rule is that the
  DataLoader has ``num_workers=0``, where a sampler index is pulled only when a batch is
  handed to the loop, and :func:`find_sampler` enforces it.
* **Replaying epoch 0.** The epoch is part of the saved state and advances by itself at the end
  of an epoch; :meth:`~ResumableSampler.set_epoch` never goes back.

Data are spread over ranks like ``DistributedSampler`` (rank ``r`` of ``R`` takes every
``R``-th entry) but on the *global* order: after every rank consumed ``k`` samples, the first
``k * R`` entries are done. The saved state is that global position, the same on every rank,
so a resume under a different world size continues from it and, over the epoch, no sample is
skipped or repeated (except the padding or dropping that ``drop_last`` asks for, as with
``DistributedSampler``). Rules and guarantees: ``docs/data-and-rng.md``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Mapping, Sized
from typing import Any, Final, TypeVar

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, Sampler

from trainer_sdk.errors import BatonError
from trainer_sdk.rng import mix_seed

__all__ = ["ResumableSampler", "SamplerError", "find_sampler"]

STATE_VERSION: Final = 1
"""Bumped when the layout of :meth:`ResumableSampler.state_dict` changes."""
_CHUNK: Final = 65536  # indices turned into Python ints at a time
_CHECKED_PREFIX: Final = 4096  # order entries whose digest the state carries

T = TypeVar("T")


class SamplerError(BatonError):
    """The sampler was used in a way that would silently skip, repeat or replay samples."""


class ResumableSampler(Sampler[int]):
    """A shuffling, distributed, Stateful sampler that resumes at the exact sample.

    Args:
        data_source_or_len: the dataset (anything with ``len()``) or its length.
        shuffle: draw a new permutation for every epoch from ``(seed, epoch)``; if False the
            order is ``0..N-1`` every epoch.
        seed: the permutation seed; must be the same on every rank and across restarts.
        num_replicas: the world size; defaults to the process group's (1 without one).
        rank: this rank; defaults to the process group's (0 without one).
        drop_last: as in ``DistributedSampler``: drop the tail of the epoch so that every rank
            gets the same count, instead of padding with entries from the start of the order.

    Usage: pass it as ``DataLoader(..., sampler=s)``, and iterate ``for batch in s.track(loader)``
    (required when ``num_workers > 0``). The Checkpointer saves ``state_dict()``; it is JSON and
    identical on every rank.
    """

    def __init__(
        self,
        data_source_or_len: Sized | int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
    ) -> None:
        super().__init__()
        if isinstance(data_source_or_len, bool):
            raise SamplerError("data_source_or_len must be a dataset or an int, not a bool")
        num_samples = (
            data_source_or_len if isinstance(data_source_or_len, int) else len(data_source_or_len)
        )
        if num_samples < 0:
            raise SamplerError(f"dataset length must be >= 0, got {num_samples}")
        distributed = dist.is_available() and dist.is_initialized()
        if num_replicas is None:
            num_replicas = dist.get_world_size() if distributed else 1
        if rank is None:
            rank = dist.get_rank() if distributed else 0
        if num_replicas < 1:
            raise SamplerError(f"num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise SamplerError(f"rank must be in [0, {num_replicas}), got {rank}")
        self._num_samples: Final = num_samples
        self._shuffle: Final = shuffle
        self._seed: Final = seed
        self._replicas: Final = num_replicas
        self._rank: Final = rank
        self._drop_last: Final = drop_last

        # The pass in progress: epoch, the global position it began at, and two counts of this
        # rank's samples since then. What the loop consumed is `_marked` once the consumer
        # counts (track / mark_consumed), else `_yielded` (exact with num_workers=0 only).
        # A pass that has consumed everything is over: the public view (epoch, position) is
        # already the next epoch's start, and `_settle` makes that real at the next boundary
        # (never eagerly while a DataLoader may still be pulling, so a late switch to consumer
        # counting cannot find its epoch already advanced by prefetching).
        self._epoch = 0
        self._start = 0
        self._yielded = 0  # handed to the DataLoader (runs ahead when workers prefetch)
        self._marked = 0  # counted at the consumer
        self._tracked = False
        self._epoch_gen = 0  # bumped when the epoch changes or state loads: track() stops
        self._pass_gen = 0  # bumped when a pass starts too: an older iterator stops
        self._loader_workers = 0  # num_workers of the loader seen by find_sampler
        self._loader_unordered = False  # that loader hands batches over out of order
        self._digest: tuple[int, str] | None = None  # (epoch, digest of its order's start)
        self._held_order: tuple[int, torch.Tensor] | None = None  # computed on load, for iter()

    # -- what it is ---------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The current epoch. It advances by itself once the epoch's last sample is consumed."""
        return self._epoch + 1 if self._pass_done() else self._epoch

    @property
    def position(self) -> int:
        """Global position in this epoch's order: how many entries all ranks have consumed."""
        return 0 if self._pass_done() else self._start + self._consumed() * self._replicas

    @property
    def num_replicas(self) -> int:
        """The world size this sampler spreads data over."""
        return self._replicas

    @property
    def rank(self) -> int:
        """The rank whose share this sampler yields."""
        return self._rank

    def __len__(self) -> int:
        """Samples per rank in a *full* epoch at this world size (like ``DistributedSampler``).

        A pass resumed mid-epoch yields fewer: :meth:`remaining` says how many.
        """
        return self._local_count(0)

    def remaining(self) -> int:
        """Samples this rank's loop has still to consume in the current epoch."""
        return self._local_count(self.position)

    def global_order(self, epoch: int | None = None) -> list[int]:
        """The whole order of ``epoch`` (default: the current one), before splitting by rank."""
        return self._order(self.epoch if epoch is None else epoch).tolist()

    # -- iteration ----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[int]:
        """Start a pass at the current position (the start of the epoch, or where the loop
        stopped: a restored position, or a ``break``)."""
        self._settle()
        # A new iter() after a break continues where the loop stopped.
        self._start = self.position
        self._yielded = self._marked = 0
        self._pass_gen += 1
        return self._generate(self._pass_gen, self._local_indices(self._start))

    def _generate(self, pass_gen: int, indices: torch.Tensor) -> Iterator[int]:
        # Python ints a chunk at a time: a list of every index of a 100M-sample epoch would
        # cost gigabytes.
        for lo in range(0, indices.numel(), _CHUNK):
            for index in indices[lo : lo + _CHUNK].tolist():
                if pass_gen != self._pass_gen:
                    return  # set_epoch / load_state_dict / a newer iter() since: pass is over
                # Without consumer counting this is also the consumed count: with
                # num_workers=0 the DataLoader pulls an index only to hand its batch to the
                # loop (find_sampler makes state_dict refuse the prefetching case).
                self._yielded += 1
                yield index

    def mark_consumed(self, n: int) -> None:
        """Tell the sampler the training loop has taken ``n`` more samples of this rank.

        From the first call on, the position saved is what was marked, not what the DataLoader
        pulled. Call it for every batch, from the first one, with the batch's sample count. If
        your loop ends an epoch without consuming every sample (a loader with
        ``drop_last=True``), call :meth:`set_epoch` with the next epoch, as with
        ``DistributedSampler``. :meth:`track` does all this for you.
        """
        if n < 0:
            raise SamplerError(f"mark_consumed takes a count >= 0, got {n}")
        self._tracked = True
        if n > self._left():
            raise SamplerError(
                f"mark_consumed({n}) but only {self._left()} samples remain in epoch "
                f"{self._epoch} on rank {self._rank}: count samples, not batches, and only "
                "those of this sampler's DataLoader"
            )
        self._marked += n

    def track(self, loader: DataLoader[Any]) -> Iterator[Any]:
        """Iterate ``loader`` (built on this sampler), counting each batch as consumed when the
        loop receives it; the epoch ends when the loader is exhausted.

        Use ``for batch in sampler.track(loader)`` instead of ``for batch in loader``. It is
        exact with any ``num_workers`` and prefetching. It also starts the iteration without
        advancing torch's global RNG: a plain ``iter(loader)`` draws a worker seed from it (unless
        the loader has its own ``generator``), so a run resumed mid-epoch would otherwise see a
        global stream one draw off from the uninterrupted run's.
        """
        per_batch = _samples_per_batch(loader, self)  # validate now, not at the first next()
        self._tracked = True
        return self._track(loader, per_batch)

    def _track(self, loader: DataLoader[Any], per_batch: int) -> Iterator[Any]:
        # Settle first: if the last pass was consumed to its end (a break after the epoch's
        # last batch), the epoch advances now, not inside iter(loader) after we took our mark.
        self._settle()
        epoch_gen = self._epoch_gen
        if loader.generator is None:
            cpu_state = torch.get_rng_state()
            iterator = iter(loader)
            torch.set_rng_state(cpu_state)
        else:
            iterator = iter(loader)
        for batch in iterator:
            if epoch_gen != self._epoch_gen:
                # set_epoch / load_state_dict while iterating: the pass this loader serves is over
                return
            self._marked += min(per_batch, self._left())
            yield batch
        if epoch_gen == self._epoch_gen:
            # Loader exhausted: the epoch is over, even when drop_last batching left a tail.
            self._complete_pass()

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch`` (``DistributedSampler`` habit: call it at the top of each epoch).

        The current epoch keeps its position (so a resumed run that calls ``set_epoch`` with
        the restored epoch continues mid-epoch); a later epoch starts at its beginning; an
        earlier one raises, because it would replay an order already trained on.
        """
        self._settle()
        if epoch == self._epoch:
            return
        if epoch < self._epoch:
            raise SamplerError(
                f"set_epoch({epoch}) would go back from epoch {self._epoch} (the sampler was "
                "restored from a checkpoint, or already finished the earlier epochs) and replay "
                "an order already trained on: start your epoch loop at sampler.epoch, or create "
                "a new ResumableSampler to start over"
            )
        self._new_pass(epoch, 0)

    # -- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-only state, the same on every rank: epoch, global position and the order's key.

        Raises :class:`SamplerError` when the position cannot be known: the sampler feeds a
        DataLoader with workers (seen by :func:`find_sampler`) and nothing counts consumption.
        """
        if self._loader_unordered:
            raise SamplerError(_UNORDERED)
        if self._loader_workers > 0 and not self._tracked and self._yielded > 0:
            raise SamplerError(
                f"the DataLoader has num_workers={self._loader_workers} and prefetches indices "
                "ahead of the training loop, so the sampler cannot know what was consumed: "
                "iterate with `for batch in sampler.track(loader)` (or call "
                "sampler.mark_consumed(n) for every batch), or use num_workers=0"
            )
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "position": self.position,
            "num_samples": self._num_samples,
            "seed": self._seed,
            "shuffle": self._shuffle,
            "num_replicas": self._replicas,  # informational: a load may use another world size
            "order_check": self._order_digest(self.epoch),
            "torch_version": torch.__version__,  # informational, for the order_check message
        }

    def load_state_dict(self, state_dict: Mapping[str, Any], /) -> None:
        """Continue from a saved state, under any world size (next ``iter()`` starts there)."""
        state = dict(state_dict)
        if state.get("version") != STATE_VERSION:
            raise SamplerError(
                f"sampler state has version {state.get('version')!r}, this Baton reads "
                f"{STATE_VERSION}: resume with the Baton version that saved it"
            )
        for key in ("epoch", "position", "num_samples", "seed"):
            if not isinstance(state.get(key), int) or isinstance(state.get(key), bool):
                raise SamplerError(f"sampler state field {key!r} must be an int: {state!r}")
        if state["num_samples"] != self._num_samples:
            raise SamplerError(
                f"the checkpoint's sampler covered {state['num_samples']} samples, this dataset "
                f"has {self._num_samples}: a saved position means nothing in another dataset; "
                "resume with the same dataset, or start a new sampler without loading its state"
            )
        if state["seed"] != self._seed or state.get("shuffle") != self._shuffle:
            raise SamplerError(
                f"the checkpoint's sampler used seed={state['seed']} shuffle="
                f"{state.get('shuffle')}, this one seed={self._seed} shuffle={self._shuffle}: "
                "construct ResumableSampler with the saved seed and shuffle to continue its order"
            )
        epoch, position = state["epoch"], state["position"]
        if epoch < 0 or not 0 <= position <= self._num_samples:
            raise SamplerError(
                f"sampler state has epoch={epoch} position={position}, outside "
                f"[0, {self._num_samples}]: the state is corrupt"
            )
        saved_check = state.get("order_check")
        if saved_check is not None and saved_check != self._order_digest(epoch):
            raise SamplerError(
                f"the order of epoch {epoch} computed here differs from the one the checkpoint "
                f"was trained on (saved with torch {state.get('torch_version')}, this is torch "
                f"{torch.__version__}, whose randperm may have changed): resuming would skip "
                "and repeat samples: resume with the saved torch version, or leave this state "
                f"out and start a new sampler at the next epoch (set_epoch({epoch + 1}))"
            )
        self._new_pass(epoch, position)
        self._settle()  # a position at the end of the epoch means the next epoch's start

    # -- internals ----------------------------------------------------------------------------

    def _order(self, epoch: int) -> torch.Tensor:
        if not self._shuffle:
            return torch.arange(self._num_samples)
        # A generator of our own, seeded from (seed, epoch) alone: no global stream is read or
        # advanced, and the order of any epoch can be recomputed at any time.
        generator = torch.Generator()
        generator.manual_seed(mix_seed(self._seed, epoch))
        return torch.randperm(self._num_samples, generator=generator)

    def _order_digest(self, epoch: int) -> str:
        """A digest of the start of ``epoch``'s order: saved with the state and checked on load,
        so that a torch whose ``randperm`` draws differently cannot silently change the order
        under a resumed run. Cached per epoch: the order costs O(N) to compute."""
        if self._digest is None or self._digest[0] != epoch:
            order = self._order(epoch)
            self._remember_digest(epoch, order)
            self._held_order = (epoch, order)  # the next iter() needs it: randperm only once
        assert self._digest is not None
        return self._digest[1]

    def _remember_digest(self, epoch: int, order: torch.Tensor) -> None:
        head = order[:_CHECKED_PREFIX].to(torch.int64)
        self._digest = (epoch, hashlib.sha256(head.numpy().tobytes()).hexdigest()[:32])

    def _local_count(self, start: int) -> int:
        rest = self._num_samples - start
        if self._drop_last:
            return rest // self._replicas
        return math.ceil(rest / self._replicas)

    def _local_indices(self, start: int) -> torch.Tensor:
        held, self._held_order = self._held_order, None
        order = held[1] if held is not None and held[0] == self._epoch else self._order(self._epoch)
        self._remember_digest(self._epoch, order)  # the order is at hand: saves stay O(1)
        rest = order[start:]
        total = self._local_count(start) * self._replicas
        if total > rest.numel():
            # Pad like DistributedSampler: with entries from the start of the epoch's order,
            # repeated if the order is shorter than the padding.
            pad = total - rest.numel()
            rest = torch.cat([rest, order.repeat(math.ceil(pad / order.numel()))[:pad]])
        else:
            rest = rest[:total]
        return rest[self._rank :: self._replicas]

    def _consumed(self) -> int:
        return self._marked if self._tracked else self._yielded

    def _left(self) -> int:
        """Samples left in the pass in progress (0 once it is over, unlike remaining())."""
        return self._local_count(self._start) - self._consumed()

    def _pass_done(self) -> bool:
        return self._consumed() >= self._local_count(self._start)

    def _settle(self) -> None:
        if self._pass_done():
            self._complete_pass()

    def _complete_pass(self) -> None:
        self._new_pass(self._epoch + 1, 0)

    def _new_pass(self, epoch: int, start: int) -> None:
        self._epoch, self._start = epoch, start
        self._yielded = self._marked = 0
        self._epoch_gen += 1
        self._pass_gen += 1


_UNORDERED: Final = (
    "the DataLoader has in_order=False and workers, so batches reach the loop out of order and "
    "no count of consumed samples can say which ones were consumed: use in_order=True (the "
    "default)"
)


def _unordered(loader: DataLoader[Any]) -> bool:
    return int(loader.num_workers) > 0 and not getattr(loader, "in_order", True)


def _samples_per_batch(loader: DataLoader[Any], sampler: ResumableSampler) -> int:
    if _unordered(loader):
        raise SamplerError(_UNORDERED)
    if loader.batch_sampler is None:
        if loader.sampler is not sampler:
            raise SamplerError("track(loader): the loader's sampler is not this ResumableSampler")
        return 1  # batch_size=None: every item is one sample
    batch_sampler = loader.batch_sampler
    if isinstance(batch_sampler, BatchSampler) and batch_sampler.sampler is sampler:
        return int(batch_sampler.batch_size)
    raise SamplerError(
        "track(loader) needs a DataLoader built with sampler=<this ResumableSampler> and a "
        f"batch_size (its batch_sampler is {type(batch_sampler).__name__}); with a custom "
        "batch_sampler call sampler.mark_consumed(len(batch)) after receiving each batch"
    )


def find_sampler(loader: DataLoader[Any]) -> ResumableSampler | None:
    """The :class:`ResumableSampler` behind ``loader``, told how the loader prefetches.

    The Checkpointer calls this for its ``dataloader``. After it, the sampler's
    ``state_dict()`` refuses to save a position that prefetching workers have run ahead of
    (``num_workers > 0`` without :meth:`ResumableSampler.track` or ``mark_consumed``).
    """
    candidates: list[object] = [getattr(loader, "sampler", None)]
    batch_sampler = getattr(loader, "batch_sampler", None)
    candidates.append(getattr(batch_sampler, "sampler", None))
    for candidate in candidates:
        if isinstance(candidate, ResumableSampler):
            candidate._loader_workers = max(candidate._loader_workers, int(loader.num_workers))
            candidate._loader_unordered = candidate._loader_unordered or _unordered(loader)
            return candidate
    return None
