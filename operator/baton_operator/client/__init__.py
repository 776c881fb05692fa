"""The client layer: the only code of the operator that does I/O.

``kube`` (the API server), ``sidecars`` (each pod's sidecar over HTTP) and ``metrics``
(Prometheus on :8080), and above them the reactions built on those calls: ``faults``
(API-error reactions), ``leader`` (the Lease) and ``tokens`` (sidecar tokens from one key).
These modules may import each other downwards only (``faults | leader | tokens`` over
``kube | sidecars | metrics``, contract "Operator client layers point down") and the ``pure``
folder; never ``reconcile`` or the handlers. Empty on purpose: import the modules themselves.
Loggers keep their names from before the folders (``baton_operator.<module>``): log filters
use them.
"""
