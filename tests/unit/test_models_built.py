"""Every wire and settings model is built when its module is imported, never on a first request.

A model pydantic cannot build at import (a forward reference it cannot resolve yet) is built by
``model_rebuild()`` on its first use; done by several threads at once, that is the race behind the
one 500 "AttributeError: __pydantic_core_schema__" seen with three in-process servers (issue 30;
pydantic issue 13419). So none of ours may be left to build lazily.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

import orbit_client
import outbox_adapter
from orbit_server import ServerSettings, create_app


def _subclasses(cls: type[BaseModel]) -> set[type[BaseModel]]:
    found: set[type[BaseModel]] = set()
    for sub in cls.__subclasses__():
        found |= {sub, *_subclasses(sub)}
    return found


def test_no_model_of_ours_is_left_to_build_on_first_use(tmp_path: Path) -> None:
    assert orbit_client.__name__ and outbox_adapter.__name__  # imported for their models
    create_app(ServerSettings(database_url=f"sqlite:///{tmp_path / 'orbit.db'}", console_secret="t"))
    ours = [m for m in _subclasses(BaseModel) if m.__module__.split(".")[0] in {"orbit_client", "orbit_server",
                                                                                 "outbox_adapter"}]  # fmt: skip
    assert len(ours) > 50
    assert [m.__qualname__ for m in ours if not m.__pydantic_complete__] == []
