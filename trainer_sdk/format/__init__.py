"""The checkpoint format: what a step is on storage, and who writes and reads which bytes.

``layout`` (names, the manifest schema and its validation, hashes) at the bottom; ``planning``
(who writes which bytes, which ranges a reader needs), ``_catalog`` (which steps exist and are
complete) and ``_safetensors_io`` (safetensors headers and verified byte ranges, over ``_crc``)
above it; ``_tree`` (the tagged-JSON tree of non-tensor state) on top. These modules import
only each other (downwards, contract "SDK format layers point down"), ``storage``, and the
leaves (``errors``, ``_types``). Torch-free where the sidecar needs it: ``layout`` imports no
torch, and this ``__init__`` imports nothing, so the sidecar can import
``trainer_sdk.format.layout``. Empty on purpose: import the modules themselves.
"""
