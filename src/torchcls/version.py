"""The package version, in a module of its own: the core records it without importing the package's front."""

__version__ = "0.1.0"
