"""One save or one load across the ranks: the engine under ``trainer_sdk.api``.

``_saving`` (write this rank's files) and ``_loading`` (read verified byte ranges into the
live state) on top; ``_committing`` (agree and commit: fencing, references, ``manifest.json``,
``latest``) and ``_coop`` (what every rank needs whole, read once and broadcast) below them.
These modules import only each other (downwards, contract "SDK saveload layers point down"),
``format``, ``storage`` and the leaves. Empty on purpose: import the modules themselves.
"""
