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
