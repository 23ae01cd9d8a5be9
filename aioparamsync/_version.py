"""The package's version (one place: hatchling reads it, the node reports it)."""

__version__ = "0.1.0"
