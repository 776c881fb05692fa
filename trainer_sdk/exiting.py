"""Leave a training process at once: the exit the operator waits for.

A process that has imported torch's compiler stack (``DistributedDataParallel`` and
``torch.use_deterministic_algorithms`` both import ``torch._dynamo``, ``torch._inductor`` and
sympy) spends about a second after its last line in CPython's module teardown: garbage
collection over some 300,000 objects, module by module, freeing memory the kernel is about to
take back anyway. The operator acts when a trainer's process has exited: a rank whose peer's
node was lost (its collective fails within a tenth of a second) is the first sign of that loss,
and a rank that stops after a notice's save is restarted, in place or in a new pod, once it is
gone. That second of teardown is on the path of every recovery (measured in
``docs/performance.md``, "Leaving a trainer at once").

:func:`run` runs a script's ``main`` and leaves the way ``sys.exit(main())`` does in everything
a script can observe, then skips the teardown:

* the exit status: ``main``'s return value (``None`` is 0), a ``SystemExit``'s code, or 1 with
  the traceback printed by ``sys.excepthook`` for an uncaught exception;
* the threads are shut down first, exactly as the interpreter does it (``threading``'s own
  shutdown: the callbacks registered with it, which stop ``concurrent.futures`` workers, then
  every non-daemon thread joined, so a background save still writing finishes);
* ``atexit`` handlers run (``logging``'s flush, multiprocessing's children, ``weakref.finalize``
  callbacks such as a ``TemporaryDirectory``'s removal, torch's own);
* ``sys.stdout``, ``sys.stderr`` and every other open file object that buffers writes are
  flushed (what a file left unclosed would otherwise lose; the kernel closes its descriptor).

``KeyboardInterrupt`` is not caught: the interpreter handles it as usual (it re-raises SIGINT).
:func:`exit_now` is the last part alone, for a script that ends in its own way.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn

__all__ = ["exit_now", "run"]

_WRITERS = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)


def run(main: Callable[[], object]) -> NoReturn:
    """Call ``main()`` and exit with its status, without Python's module teardown.

    Use it in place of ``sys.exit(main())``::

        if __name__ == "__main__":
            trainer_sdk.run(main)
    """
    try:
        code = _status(main())
    except SystemExit as stop:
        code = _status(stop.code)
    except Exception:
        sys.excepthook(*sys.exc_info())
        code = 1
    exit_now(code)


def exit_now(code: int = 0) -> NoReturn:
    """Exit with ``code`` after what a normal exit does for the program, skipping the teardown.

    Shuts the threads down and runs the ``atexit`` handlers as the interpreter's own exit does,
    in its order, flushes every open writable file object, then ``os._exit(code)``. Call it from
    the main thread. On a Python without the two private hooks this needs
    (``threading._shutdown``, ``atexit._run_exitfuncs``; CPython has both) it is ``sys.exit``.
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "trainer_sdk.exit_now() must be called from the main thread (it joins the others)"
        )
    # What Py_FinalizeEx does before it tears the modules down: threading's shutdown (its
    # registered callbacks, such as the one that stops ThreadPoolExecutor workers, which are
    # not daemons and wait on a queue; then the main thread marked stopped, which threads
    # watching it read; then every non-daemon thread joined), then the atexit handlers.
    # Joining the threads without the rest would wait forever on such a worker.
    shutdown = getattr(threading, "_shutdown", None)
    run_exitfuncs = getattr(atexit, "_run_exitfuncs", None)
    if shutdown is None or run_exitfuncs is None:
        sys.exit(code)
    shutdown()
    run_exitfuncs()
    _flush_writers()
    os._exit(code)


def _status(code: object) -> int:
    """The exit status ``sys.exit(code)`` gives: None is 0, an int itself, anything else is
    printed to stderr and gives 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _flush_writers() -> None:
    """Flush every open file object that buffers writes (the standard streams among them).

    The interpreter's teardown would flush them as it freed them; ``os._exit`` does not. The
    scan takes about 0.1 s with torch loaded, a tenth of the teardown it replaces. A flush
    that fails (a closed pipe, a full disk) is reported on file descriptor 2 and the others
    still flushed, as the teardown does ("Exception ignored ...").
    """
    streams: list[object] = [sys.stdout, sys.stderr]  # possibly not io objects (a wrapper)
    streams += [o for o in gc.get_objects() if type(o) in _WRITERS and not o.closed]
    for stream in streams:
        flush = getattr(stream, "flush", None)
        if flush is None:
            continue
        try:
            flush()
        except (OSError, ValueError) as err:
            name = getattr(stream, "name", type(stream).__name__)
            line = f"trainer_sdk.exit_now: could not flush {name!r} before exiting: {err}\n"
            with contextlib.suppress(OSError):  # descriptor 2 itself is gone: nowhere to say it
                os.write(2, line.encode("utf-8", "replace"))
