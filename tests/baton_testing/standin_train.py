"""A stand-in for a user's ``train.py``: the deploy/examples tests run the examples with it.

It imports no torch and trains nothing, so that 32 processes of ``multi-node-spot.yaml`` fit
on a 2-core machine. It checks what a training process of the job must see, whether a launcher
(``torchrun``) started it or the pod did directly, and records it in
``$STANDIN_OUT/rank-<RANK>.json``: the global rank, the world size, the local rank and the
rendezvous address. It exits 1 with the reason when something is missing, so a job whose env
is wrong fails instead of succeeding. Its arguments (``--config ...``) are recorded, not read.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

_NEEDED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def main() -> int:
    missing = [name for name in _NEEDED if not os.environ.get(name)]
    if missing:
        print(f"standin: missing {missing}: was this started by the right launcher?", flush=True)
        return 1
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not 0 <= rank < world:
        print(f"standin: RANK {rank} outside WORLD_SIZE {world}", flush=True)
        return 1
    out = Path(os.environ["STANDIN_OUT"])
    out.mkdir(parents=True, exist_ok=True)
    seen = {name: os.environ[name] for name in (*_NEEDED, "BATON_CHECKPOINT_URI", "BATON_JOB")}
    seen["argv"] = sys.argv[1:]
    (out / f"rank-{rank}.json").write_text(json.dumps(seen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
