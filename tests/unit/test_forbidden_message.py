"""A 403 says which key would do (issue 23: it read "needs the 'admin' role or admin")."""

from __future__ import annotations

from orbit_server.api.auth import forbidden_detail


def test_an_admin_action_names_an_admin_key_once() -> None:
    assert forbidden_detail("submit", "admin") == "a 'submit' key cannot do this; it needs an 'admin' key"


def test_another_action_names_its_role_and_admin() -> None:
    assert (
        forbidden_detail("read", "work")
        == "a 'read' key cannot do this; it needs a 'work' key (or an 'admin' key)"
    )
