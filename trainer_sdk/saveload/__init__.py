"""One save or one load across the ranks: the engine under ``trainer_sdk.api``.

Top to bottom (contract "SDK saveload layers point down"): ``_saving`` (write this rank's
files) and ``_loading`` (read verified byte ranges into the live state); ``_committing`` (agree
and commit: fencing, references, ``manifest.json``, ``latest``) and ``_coop`` (what every rank
needs whole, read once and broadcast) and ``_host_buffers`` (an async save's reusable host
copies, in memfds for a writer process); at the bottom ``_collectives`` (every collective the SDK
runs, bounded; every layer above uses it), ``_progress`` (progress lines for the tools) and
``_writer_process`` (an async save's shard written by a child process from shared memory).
These modules import only each other (downwards), ``format``, ``storage`` and the leaves.
Empty on purpose: import the modules themselves.
"""
