"""Baton's in-pod sidecar: HTTP control for the operator, cloud notice pollers, metrics.

It imports only the torch-free :mod:`trainer_sdk.control` from the SDK.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
