"""The reconciler: ``Reconciler.tick`` and the rooms it builds once and hands to those above.

One module per concern, layered top to bottom in ``pyproject.toml`` ("Operator reconcile
layers point down"): ``controller``, ``recovering``, ``noticing``, ``suspending | progress``,
``actions``, ``creating | replicating``, ``services``, ``writing``. These modules may import
each other downwards only, and the ``client`` and ``pure`` folders; never the entry point, the
kopf handlers or ``rbac`` above them. Empty on purpose: import the modules themselves. Loggers
keep their names from before the folders (``baton_operator.<module>``): log filters use them.
"""
