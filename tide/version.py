"""The package version (importable without loading the engine)."""

__version__ = "0.1.0"
