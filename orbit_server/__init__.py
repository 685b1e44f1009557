"""Orbit server: idempotent task acceptance over HTTP (FastAPI + SQLAlchemy 2).

Run it with ``orbit-server serve``; embed it with :func:`create_app`.
"""

from .app import create_app
from .settings import ServerSettings

__all__ = ["ServerSettings", "__version__", "create_app"]
__version__ = "0.1.0"
