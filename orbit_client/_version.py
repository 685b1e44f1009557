"""The package version, kept apart so internal modules can read it without importing ``orbit_client``."""

__version__ = "0.1.0"
