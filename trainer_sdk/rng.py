"""Capture and restore every global random stream of one rank, as tensors and JSON.

An exact resume needs the random streams to continue where they stopped: dropout masks come
from torch's CPU or CUDA generator, data augmentation often from python's ``random`` or
numpy's global ``RandomState``. :func:`capture` returns all of them in a form that the
checkpoint format stores without pickle (a few small tensors and JSON values), meant to be
saved per rank under ``trainer_sdk.RankLocal``. :func:`restore` puts them back.

After a world-size change a new rank has no saved streams. :func:`derive` builds a
deterministic state for it from values every rank agrees on (for example the step and the
rank), so that a resumed run is reproducible even though it cannot be bitwise equal to a run
at the old world size (see ``docs/data-and-rng.md``).

What is not captured: ``torch.Generator`` and ``numpy.random.Generator`` objects that user code
creates itself (keep them in the checkpoint as state of your own), RNGs inside DataLoader worker
processes, and accelerators other than CUDA.
"""

from __future__ import annotations

import math
import random
import warnings
from collections.abc import Mapping
from typing import Any, Final

import numpy as np
import torch

from trainer_sdk.errors import BatonError

__all__ = ["RngError", "capture", "derive", "mix_seed", "restore"]

FORMAT_VERSION: Final = 1
"""Bumped when the layout of the captured dict changes; :func:`restore` refuses others."""

_MASK64: Final = (1 << 64) - 1
_MT_KEYS: Final = 624  # words of Mersenne Twister state in python's random and numpy's legacy RNG
_TORCH_CPU_STATE_BYTES: Final = 5056  # sizeof(CPUGeneratorImplState) in torch's ATen

# Stream labels mixed into derived seeds, so that no two streams of a rank share a seed.
_STREAM_PYTHON: Final = 1
_STREAM_NUMPY: Final = 2
_STREAM_TORCH: Final = 3
_STREAM_CUDA: Final = 4


class RngError(BatonError):
    """A captured RNG state cannot be restored (wrong shape, type or version)."""


def mix_seed(*parts: int) -> int:
    """Mix integers into one well-spread 64-bit seed (SplitMix64 over the parts, in order).

    Unlike ``seed + epoch`` or ``seed + rank``, nearby inputs give unrelated seeds, so
    ``(seed=1, epoch=0)`` and ``(seed=0, epoch=1)`` do not collide. Negative parts are taken
    modulo 2**64. The result is stable across processes, machines and Python versions.
    """
    h = 0x243F6A8885A308D3  # any odd constant: keeps mix_seed() of no parts away from zero
    for part in parts:
        h = _splitmix64(h ^ (part & _MASK64))
    return h


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def capture() -> dict[str, Any]:
    """Return this process's global RNG states; calling it draws from none of them.

    Keys: ``version``; ``python`` (``random.getstate()`` as JSON ints); ``numpy`` (the legacy
    global ``RandomState``: ``keys`` as a uint32 tensor plus ``pos``/``has_gauss``/
    ``cached_gaussian``); ``torch`` (the CPU generator's byte state); and ``cuda`` (one byte
    state per visible device, keyed ``"0"``, ``"1"``, ...) only when CUDA has been initialised
    in this process. A process that never initialised CUDA has drawn nothing from it, so its
    seeding (queued lazily by ``torch.manual_seed``) is recreated by the same start-up code on
    resume, and capturing it would initialise CUDA (a context per device) for nothing.
    """
    version, py_state, gauss_next = random.getstate()
    out: dict[str, Any] = {
        "version": FORMAT_VERSION,
        "python": {"version": int(version), "state": list(py_state), "gauss_next": gauss_next},
        "numpy": _capture_numpy(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        # One state per device: a rank normally draws from cuda:LOCAL_RANK only, but any device
        # it touched has advanced, and they are small (16 bytes each for Philox).
        out["cuda"] = {str(i): s for i, s in enumerate(torch.cuda.get_rng_state_all())}
    return out


def _capture_numpy() -> dict[str, Any]:
    state = np.random.get_state(legacy=True)
    # The global RandomState is MT19937 by construction and np.random.set_state accepts
    # nothing else, so the legacy tuple form is always what comes back.
    assert isinstance(state, tuple)
    return _numpy_entry(state)


def _numpy_entry(state: tuple[str, Any, int, int, float]) -> dict[str, Any]:
    name, keys, pos, has_gauss, cached_gaussian = state
    return {
        "bit_generator": str(name),
        # copy: get_state hands out numpy's own array, and torch.from_numpy would share it
        "keys": torch.from_numpy(np.ascontiguousarray(keys, dtype=np.uint32).copy()),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached_gaussian),
    }


def restore(state: Mapping[str, Any]) -> None:
    """Put back the streams present in ``state`` (from :func:`capture` or :func:`derive`).

    Streams absent from ``state`` are left untouched, so a partial dict restores just those
    streams. Every part is validated before any stream is changed: a malformed state raises
    :class:`RngError` and leaves all streams as they were. Restoring draws from no stream and
    does not touch generator objects that user code owns.

    CUDA: states are restored on the devices that exist. When the saved and current device
    counts differ (a different node shape), the common devices are restored and a warning names
    the rest: the run goes on, but not bitwise. A ``cuda_seed`` (from :func:`derive`) seeds every
    device with ``torch.cuda.manual_seed_all``, which is queued until CUDA initialises.
    """
    if not isinstance(state, Mapping):
        raise RngError(
            f"RNG state must be a dict from trainer_sdk.rng.capture(), got {type(state).__name__}"
        )
    version = state.get("version")
    if version != FORMAT_VERSION:
        raise RngError(
            f"RNG state has format version {version!r}, this Baton reads {FORMAT_VERSION}: "
            "restore it with the Baton version that saved it, or drop the RNG state and reseed"
        )
    unknown = set(state) - {"version", "python", "numpy", "torch", "cuda", "cuda_seed"}
    if unknown:
        raise RngError(
            f"RNG state has unknown keys {sorted(unknown)}: pass the dict from "
            "trainer_sdk.rng.capture() or derive() unchanged"
        )
    # Validate everything first, then apply: a half-restored set of streams is worse than none.
    py = _check_python(state["python"]) if "python" in state else None
    npy = _check_numpy(state["numpy"]) if "numpy" in state else None
    cpu = _check_byte_state("torch", state["torch"]) if "torch" in state else None
    cuda = _check_cuda(state["cuda"]) if "cuda" in state else None
    cuda_seed = _check_seed("cuda_seed", state["cuda_seed"]) if "cuda_seed" in state else None

    if py is not None:
        random.setstate(py)
    if npy is not None:
        np.random.set_state(npy)
    if cpu is not None:
        torch.set_rng_state(cpu)
    if cuda is not None:
        _restore_cuda(cuda)
    if cuda_seed is not None and torch.cuda.is_available():
        torch.cuda.manual_seed_all(cuda_seed)


def _check_python(value: Any) -> tuple[int, tuple[int, ...], float | None]:
    fix = "pass the 'python' entry of trainer_sdk.rng.capture() unchanged"
    if not isinstance(value, Mapping):
        raise RngError(f"RNG state 'python' must be a dict: {fix}")
    version, words, gauss = value.get("version"), value.get("state"), value.get("gauss_next")
    if isinstance(words, torch.Tensor) and words.dim() == 1 and _is_integer(words.dtype):
        # Also accepted as an integer tensor: one tensor is cheaper to flatten and store than
        # 625 JSON leaves (the Checkpointer packs it so).
        words = [int(w) for w in words.tolist()]
    if not isinstance(version, int) or not isinstance(words, list | tuple):
        raise RngError(f"RNG state 'python' needs an int 'version' and a list 'state': {fix}")
    if len(words) != _MT_KEYS + 1 or not all(
        isinstance(w, int) and not isinstance(w, bool) and 0 <= w <= 0xFFFFFFFF for w in words
    ):
        raise RngError(f"RNG state 'python.state' must be {_MT_KEYS + 1} uint32 ints: {fix}")
    if gauss is not None and not (isinstance(gauss, float | int) and math.isfinite(gauss)):
        raise RngError(f"RNG state 'python.gauss_next' must be a finite float or null: {fix}")
    return version, tuple(words), None if gauss is None else float(gauss)


def _is_integer(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _check_numpy(value: Any) -> tuple[str, np.ndarray[Any, Any], int, int, float]:
    fix = "pass the 'numpy' entry of trainer_sdk.rng.capture() unchanged"
    if not isinstance(value, Mapping):
        raise RngError(f"RNG state 'numpy' must be a dict: {fix}")
    name, keys = value.get("bit_generator"), value.get("keys")
    pos, has_gauss, cached = value.get("pos"), value.get("has_gauss"), value.get("cached_gaussian")
    if name != "MT19937":
        raise RngError(f"RNG state 'numpy.bit_generator' must be 'MT19937', got {name!r}: {fix}")
    if not isinstance(keys, torch.Tensor) or keys.shape != (_MT_KEYS,):
        raise RngError(f"RNG state 'numpy.keys' must be a tensor of {_MT_KEYS} words: {fix}")
    if not _is_integer(keys.dtype):
        raise RngError(f"RNG state 'numpy.keys' must hold integers, got {keys.dtype}: {fix}")
    # Storage may widen the dtype (uint32 -> int64); the values are what matter.
    words = keys.detach().to("cpu", torch.int64)
    if int(words.min()) < 0 or int(words.max()) > 0xFFFFFFFF:
        raise RngError(f"RNG state 'numpy.keys' must be uint32 values: {fix}")
    if not isinstance(pos, int) or not 0 <= pos <= _MT_KEYS:
        raise RngError(f"RNG state 'numpy.pos' must be an int in [0, {_MT_KEYS}]: {fix}")
    if has_gauss not in (0, 1) or not isinstance(cached, float | int):
        raise RngError(f"RNG state 'numpy.has_gauss'/'cached_gaussian' are malformed: {fix}")
    return ("MT19937", words.numpy().astype(np.uint32), pos, int(has_gauss), float(cached))


def _check_byte_state(name: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        got = (
            f"{value.dtype} {tuple(value.shape)}"
            if isinstance(value, torch.Tensor)
            else type(value)
        )
        raise RngError(
            f"RNG state {name!r} must be a 1-D uint8 tensor, got {got}: pass the entry of "
            "trainer_sdk.rng.capture() unchanged"
        )
    if name == "torch" and value.numel() != _TORCH_CPU_STATE_BYTES:
        raise RngError(
            f"RNG state 'torch' has {value.numel()} bytes, torch's CPU generator needs "
            f"{_TORCH_CPU_STATE_BYTES}: it was not produced by torch.get_rng_state()"
        )
    # set_rng_state wants a contiguous CPU ByteTensor; a loaded state may live elsewhere.
    return value.detach().to("cpu").contiguous()


def _check_cuda(value: Any) -> list[torch.Tensor]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise RngError(
            "RNG state 'cuda' must be a dict of device index -> uint8 tensor: pass the entry of "
            "trainer_sdk.rng.capture() unchanged"
        )
    if sorted(value, key=_device_key) != [str(i) for i in range(len(value))]:
        raise RngError(
            f"RNG state 'cuda' must have keys '0'..'{len(value) - 1}', got {sorted(value)}"
        )
    return [_check_byte_state(f"cuda.{i}", value[str(i)]) for i in range(len(value))]


def _device_key(k: str) -> int:
    return int(k) if k.isdigit() else -1


def _check_seed(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= _MASK64:
        raise RngError(f"RNG state {name!r} must be an int in [0, 2**64), got {value!r}")
    return value


def _restore_cuda(states: list[torch.Tensor]) -> None:
    if not torch.cuda.is_available():
        warnings.warn(
            f"the checkpoint holds CUDA RNG states for {len(states)} device(s) but CUDA is not "
            "available here: CUDA streams are not restored, so the run is not bitwise exact",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    count = torch.cuda.device_count()
    if count != len(states):
        warnings.warn(
            f"the checkpoint holds CUDA RNG states for {len(states)} device(s), this process "
            f"sees {count}: restoring devices 0..{min(count, len(states)) - 1} only, so the run "
            "is not bitwise exact (keep CUDA_VISIBLE_DEVICES the same across restarts)",
            RuntimeWarning,
            stacklevel=3,
        )
    for index, device_state in enumerate(states[:count]):
        # set_rng_state is queued lazily when CUDA is not initialised yet, like manual_seed.
        torch.cuda.set_rng_state(device_state, device=index)


def derive(seed_material: int, rank: int) -> dict[str, Any]:
    """A deterministic RNG state for ``rank``, for :func:`restore`; changes no stream itself.

    Use it for a rank that has no saved state, after a world-size change. ``seed_material``
    must be the same on every rank (for example a run seed mixed with the checkpoint's step),
    so that a rerun of the same resume draws the same numbers. Each stream (python, numpy,
    torch CPU, CUDA) of each rank gets its own seed from :func:`mix_seed`. CUDA is seeded with
    one seed for every device, like ``torch.manual_seed`` does, and lazily, so deriving never
    initialises CUDA.
    """
    if rank < 0:
        raise RngError(f"rank must be >= 0, got {rank}")
    base = mix_seed(seed_material, rank)
    # S311: reproducible simulation streams are the point here, not secrecy
    python_rng = random.Random(mix_seed(base, _STREAM_PYTHON))  # noqa: S311
    py_version, py_state, py_gauss = python_rng.getstate()
    legacy = np.random.RandomState(
        np.random.MT19937(np.random.SeedSequence(mix_seed(base, _STREAM_NUMPY)))
    )
    numpy_state = legacy.get_state(legacy=True)
    assert isinstance(numpy_state, tuple)  # a RandomState over MT19937 always gives the tuple
    cpu = torch.Generator()
    cpu.manual_seed(mix_seed(base, _STREAM_TORCH))
    return {
        "version": FORMAT_VERSION,
        "python": {"version": py_version, "state": list(py_state), "gauss_next": py_gauss},
        "numpy": _numpy_entry(numpy_state),
        "torch": cpu.get_state(),
        "cuda_seed": mix_seed(base, _STREAM_CUDA),
    }
