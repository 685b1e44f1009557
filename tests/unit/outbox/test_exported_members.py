"""The public face of outbox_adapter: exactly ``__all__``, and no arrow to orbit_server (DESIGN §1)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import outbox_adapter


def test_all_is_exactly_the_public_names() -> None:
    public = {name for name in dir(outbox_adapter) if not name.startswith("_")}
    public = {name for name in public if not isinstance(getattr(outbox_adapter, name), type(sys))}
    assert set(outbox_adapter.__all__) == public
    assert len(outbox_adapter.__all__) == len(set(outbox_adapter.__all__))


def test_public_names_show_the_package() -> None:
    assert outbox_adapter.Relay.__module__ == "outbox_adapter"
    assert outbox_adapter.ResultConsumer.__module__ == "outbox_adapter"
    assert outbox_adapter.OutboxError.__module__ == "outbox_adapter"
    assert repr(outbox_adapter.OutboxTables()) == (
        "OutboxTables(name='orbit_outbox', events_name='orbit_outbox_events', inbox_name='orbit_inbox', "
        "keys_name='orbit_outbox_keys')"
    )
    assert outbox_adapter.OutboxTables(name="shop_outbox").inbox_name == "shop_inbox"
    assert outbox_adapter.OutboxTables(name="ob_1").inbox_name == "ob_1_inbox"


def test_one_exception_root() -> None:
    errors = [getattr(outbox_adapter, n) for n in outbox_adapter.__all__ if n.endswith("Error")]
    assert errors and all(issubclass(e, outbox_adapter.OutboxError) for e in errors)
    assert issubclass(outbox_adapter.OutboxUsageError, ValueError)
    error = outbox_adapter.InvalidStateError("row 3 is DELIVERED", row_id=3, state="DELIVERED")
    assert (error.row_id, error.state, str(error)) == (3, "DELIVERED", "row 3 is DELIVERED")


def test_the_adapter_never_imports_the_server() -> None:
    code = textwrap.dedent(
        """
        import sys
        import outbox_adapter, outbox_adapter.cli
        loaded = sorted(m for m in sys.modules if m.split(".")[0] == "orbit_server")
        assert not loaded, loaded
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_names_load_on_first_use_and_every_name_has_its_module() -> None:
    """`import outbox_adapter` imports no module of the adapter, SQLAlchemy nor the client (`orbit-outbox --help`
    stays fast); a name imports its own module on first use, and the classes it brings show the package."""
    assert sorted(outbox_adapter._HOMES) == sorted(outbox_adapter.__all__)
    code = textwrap.dedent(
        """
        import sys
        import outbox_adapter
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("sqlalchemy", "alembic", "orbit_client",
                        "pydantic", "rich", "click") or m.startswith("outbox_adapter."))
        assert not loaded, loaded
        from outbox_adapter import enqueue
        from outbox_adapter._exceptions import OutboxUsageError
        assert OutboxUsageError.__module__ == "outbox_adapter", OutboxUsageError.__module__
        assert "outbox_adapter._relay" not in sys.modules
        assert "Relay" in dir(outbox_adapter) and enqueue is outbox_adapter.enqueue
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_missing_outbox_dependency_names_the_extra_on_first_use() -> None:
    """A client-only install (no SQLAlchemy): importing the package works, using it says which extra."""
    code = textwrap.dedent(
        """
        import sys
        sys.modules["sqlalchemy"] = None  # as if it were not installed
        import outbox_adapter
        try:
            outbox_adapter.enqueue
        except ModuleNotFoundError as exc:
            assert exc.name == "sqlalchemy" and "pip install 'orbit-tasks[outbox]'" in str(exc), exc
        else:
            raise AssertionError("no error")
        try:
            from outbox_adapter import Relay
        except ModuleNotFoundError as exc:
            assert "pip install 'orbit-tasks[outbox]'" in str(exc), exc
        else:
            raise AssertionError("no error")
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)
