"""The pure layer: decisions and builders with no I/O, unit-tested without a cluster.

Phases and transitions, ``JobStatus``, ``PodView``, notices, the adaptive checkpoint interval,
economics, manifests, the CRD and its model, settings and the wire vocabulary. These modules
may import each other freely and nothing else of the operator: the ``reconcile`` and ``client``
folders sit above them (contract "Operator folders point down"). Empty on purpose: import the
modules themselves. Loggers keep their names from before the folders
(``baton_operator.<module>``): log filters use them.
"""
