"""The SDK's version, in a module of its own so that SDK modules can read it without importing
the package root (whose ``TYPE_CHECKING`` imports name every layer, for users' type checkers)."""

__version__ = "0.1.0"
