"""Baton as a storage backend of ``torch.distributed.checkpoint`` (DCP).

Anything that saves through DCP (torchtitan's own manager, Lightning's FSDP and model-parallel
strategies, verl, Ray Train, a hand-written FSDP2 loop) writes Baton checkpoints by passing a
:class:`BatonWriter`, and reads them back with a :class:`BatonReader` and a
:class:`BatonLoadPlanner`::

    import torch.distributed.checkpoint as dcp
    from trainer_sdk.integrations.dcp import BatonLoadPlanner, BatonReader, BatonWriter

    dcp.save(state, storage_writer=BatonWriter("s3://bucket/run", step=step))
    dcp.load(state, storage_reader=BatonReader("s3://bucket/run"), planner=BatonLoadPlanner())

What a step written this way is: Baton's format (``docs/format.md``): one safetensors shard per
rank, holding the chunks DCP's planner gave that rank, with a crc32 per block and a BLAKE3 of the
file; the per-rank JSON files; and the JSON manifest, created exclusively by the coordinator as
the commit, after the fencing check, then ``latest``. DCP's own planners decide who writes what
(their de-duplication of replicated tensors and DTensor shards included) and, on load, which
byte boxes each rank needs: resharding to another world size or placement is theirs.

**No pickle.** DCP's ``FileSystemWriter`` pickles its ``.metadata`` file and every non-tensor
value (``torch.save`` of an ``io.BytesIO``). Here the reader builds DCP's ``Metadata`` from the
JSON manifest, and non-tensor values (a step counter, a scheduler's state) are stored as
Baton's tagged JSON: the writer takes the value from the planner's state dict
(``lookup_object``, which ``DefaultSavePlanner`` and its subclasses have) instead of the bytes
DCP would pickle, and :class:`BatonLoadPlanner` (a ``DefaultLoadPlanner``) decodes it. Loading
a step with non-tensor values through DCP's default load planner is refused with the fix
(``planner=BatonLoadPlanner()``), never handed to ``torch.load``.

The same step is a Baton step in every other way: ``trainer_sdk.load`` (it returns the flat
dict of DCP's keys), ``python -m trainer_sdk verify|inspect|export-hf``, retention and fencing.
The other direction holds where keys match: a step the ``Checkpointer`` or ``trainer_sdk.save``
wrote loads through ``dcp.load`` into a state dict whose flattened keys (DCP's dotted paths:
``"model.layer.weight"``, ``"optim.state.0.exp_avg"``) equal Baton's tensor keys (also dotted
paths) and whose non-tensor leaves sit at the same dict paths. ``RankLocal`` values have no
DCP equivalent and are not offered to it.

Only the tensors a rank reads are fetched, as verified ranged reads (``Reader.read_box``): a
reader of one DTensor shard reads that shard's bytes, not the file.

**Notices.** A DCP loop has no ``Checkpointer`` to hear SIGTERM and the sidecar's requests;
:class:`BatonNotices` is that part alone, served at the loop's own step boundary::

    notices = BatonNotices()                      # every rank, after init_process_group
    start = notices.resume(state)                 # dcp.load of the newest complete step, or None
    for step in range(start + 1 if start is not None else 1, steps + 1):
        train_step(step)
        if notices.should_save(step, periodic=step % 100 == 0):  # every rank, every step
            notices.save(state, step)             # dcp.save; after a notice: exit 75

Every rank hears what any rank heard (one ``all_reduce`` of 8 integers per step on a gloo group
of its own), so all save the same step; the status goes to the sidecar as the Checkpointer's
does (``requested``, ``saving``, ``committed``, the step, the trigger), and after a notice save
the process exits with 75 (``EX_TEMPFAIL``: "checkpointed on notice", the operator's contract).
What it does not do that the ``Checkpointer`` does: estimate whether the save fits before the
deadline (it always tries, and storage retries stop at the deadline minus the margin), the
memory tier, and async saves (``dcp.async_save`` through a ``BatonWriter`` works, outside it).
"""

from __future__ import annotations

from trainer_sdk.integrations.dcp.notices import BatonNotices
from trainer_sdk.integrations.dcp.reader import BatonLoadPlanner, BatonReader
from trainer_sdk.integrations.dcp.writer import BatonWriter

__all__ = ["BatonLoadPlanner", "BatonNotices", "BatonReader", "BatonWriter"]
