"""Baton's Kubernetes operator (kopf): runs TrainingJob resources through preemptions.

The package is called ``baton_operator`` and lives in ``operator/``; nothing here is
importable as ``operator``, which would shadow the standard library.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
