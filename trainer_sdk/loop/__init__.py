"""The Checkpointer's parts: what runs around the training loop, under ``trainer_sdk.checkpointer``.

Top to bottom (contract "SDK loop layers point down"): ``_restoring`` (which step every rank
loads, the fallback between the tiers), ``_notices`` (an agreed notice served) and
``_agreeing`` (the notice agreement at each step boundary); then ``_save_engine`` (durable
saves in the foreground or background, memory snapshots, promotion); then its parts
``_status`` (this rank's status file for the sidecar), ``_training_state`` (what a loop's
checkpoint holds), ``_config`` (``CheckpointerConfig``), ``_memory_tier`` and ``_reuse``
(incremental steps); at the bottom ``signals`` (SIGTERM and control requests to one agreed
step), ``_deadline`` (will a save fit before a deadline), ``_ddp`` (DDP's bucket layout) and
``_promotion`` (a snapshot copied to durable storage). Below this folder: ``staging``, ``hf``,
``api``, ``saveload``, ``format``, ``storage`` and the leaves.
Empty on purpose: import the modules themselves. Loggers keep their names from before the
folders (``trainer_sdk.checkpointer``, ``trainer_sdk.signals``, ...): log filters use them.
"""
