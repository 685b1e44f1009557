"""``python -m outbox_adapter.cli``: the ``orbit-outbox`` command."""

from outbox_adapter.cli import main

main()
