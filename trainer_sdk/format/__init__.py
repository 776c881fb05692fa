"""The checkpoint format: what a step is on storage, and who writes and reads which bytes.

Top to bottom (contract "SDK format layers point down"): ``_tree`` (the tagged-JSON tree of
non-tensor state, encoder and decoder side by side); ``planning`` (who writes which bytes,
which ranges a reader needs), ``_catalog`` (which steps exist and are complete) and
``_safetensors_io`` (safetensors headers and verified byte ranges); at the bottom ``layout``
(names, the manifest schema and its validation, hashes), ``_crc`` (block checksums),
``_types`` (``Stateful`` and ``RankLocal``, what a state may hold) and ``_shard_stream`` (a
shard's bytes streamed and hashed as written, torch-free: the async writer process uses it).
These modules import only each other (downwards), ``storage`` and the leaves (``errors``).
``layout`` and ``_shard_stream`` import no torch, and this ``__init__`` imports nothing, so
the sidecar can import ``trainer_sdk.format.layout`` without torch. Empty on purpose: import
the modules themselves.
"""
