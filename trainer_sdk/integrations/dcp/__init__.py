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
rank, holding the chunks DCP's planner gave that rank, with an XXH3-64 per block and an XXH3-128
of the file; the per-rank JSON files; and the JSON manifest, created exclusively by the
coordinator as the commit, after the fencing check, then ``latest``. DCP's own planners decide
who writes what (their de-duplication of replicated tensors and DTensor shards included) and,
on load, which byte boxes each rank needs: resharding to another world size or placement is
theirs.

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
What it does not do that the ``Checkpointer`` does: skip a save that cannot fit before the
deadline (it always tries, and storage retries stop at the deadline minus the margin), and
async saves (``dcp.async_save`` through a ``BatonWriter`` works, outside it).

**The memory tier.** ``BatonNotices(fast_dir=..., fast_every_steps=N)`` (or
``$BATON_FAST_DIR``/``$BATON_FAST_EVERY_STEPS``, as the operator sets them for a
``Checkpointer``) gives a DCP loop the ``Checkpointer``'s memory tier, from the same parts
(``docs/checkpointer.md``, "The memory tier")::

    if notices.snapshot_due(step):                # every rank, after the durable save
        notices.snapshot(state, step)             # a copy; written and replicated behind

A snapshot is the loop's state dict flattened by Baton (its keys are DCP's names), written,
committed per pod, replicated to a peer by the sidecar and promoted by the ``MemoryTier``, and
read back with a ``BatonReader``. ``resume`` is the ``Checkpointer``'s restore with each
candidate loaded by ``dcp.load``: the newest step every rank can load of either tier (the
snapshot first at the same step), a snapshot cut short or corrupt passed over for the next
candidate, a restored snapshot that is not durable promoted in the background, and
``BATON_RESUME_STEP`` checked. A notice whose durable save is estimated not to end before its
deadline while a replicated snapshot would commits to the memory tier (the ``Checkpointer``'s
``choose_tier``, on measured saves and snapshots), is promoted, and exits 76 once the promotion
ended (``EXIT_RESTART_IN_PLACE``). A caller that takes no snapshots passes
``BatonNotices(memory_tier=False)``: no tier is built whatever the variables say, and
``notices.fast_ignored`` names the ones that were set, for the caller's warning (Lightning's
``BatonCallback`` does this).
"""

from __future__ import annotations

from trainer_sdk.integrations.dcp.notices import BatonNotices
from trainer_sdk.integrations.dcp.reader import BatonLoadPlanner, BatonReader
from trainer_sdk.integrations.dcp.writer import BatonWriter

__all__ = ["BatonLoadPlanner", "BatonNotices", "BatonReader", "BatonWriter"]
