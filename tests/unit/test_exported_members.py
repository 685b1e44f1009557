"""The public face of orbit_client: exactly ``__all__`` (as httpx's tests/test_exported_members.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import orbit_client


def test_all_is_exactly_the_public_names() -> None:
    public = {name for name in dir(orbit_client) if not name.startswith("_")} | {"__version__"}
    # Submodules become attributes of the package once imported; they are all private.
    public = {name for name in public if not isinstance(getattr(orbit_client, name), type(sys))}
    assert set(orbit_client.__all__) == public
    assert len(orbit_client.__all__) == len(set(orbit_client.__all__))
    assert orbit_client.__version__ == "0.1.0"


def test_public_names_show_the_package() -> None:
    assert orbit_client.OrbitClient.__module__ == "orbit_client"
    assert orbit_client.OrbitOutcomeUnknownError.__module__ == "orbit_client"


def test_importing_the_client_pulls_in_no_database_code() -> None:
    """DESIGN §1: a user who only submits tasks over HTTP never imports SQLAlchemy."""
    code = textwrap.dedent(
        """
        import sys
        import orbit_client
        banned = ("sqlalchemy", "pymysql", "psycopg", "orbit_server", "outbox_adapter")
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in banned)
        assert not loaded, loaded
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)
