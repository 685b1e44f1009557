"""``python manage.py orbit_outbox [--database ALIAS] COMMAND ...``: the ``orbit-outbox`` commands
(``migrate``, ``relay``, ``reconcile``, ``status``, ``list``, ``retry``, ``purge``, ``consume``, ...)
on a ``DATABASES`` alias, with ``settings.ORBIT`` as their defaults (README "Django")."""

from __future__ import annotations

import os
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from outbox_adapter.django._settings import database_url, orbit_settings

#: ``settings.ORBIT`` keys → the environment variables ``orbit-outbox`` reads (an environment
#: variable already set wins, and an option on the command line wins over both).
_ENVIRONMENT = {
    "ORBIT_URL": "ORBIT_URL",
    "API_KEY": "ORBIT_API_KEY",
    "NAMESPACE": "ORBIT_NAMESPACE",
    "TABLE": "ORBIT_OUTBOX_TABLE",
}


class Command(BaseCommand):
    help = (
        "Run an orbit-outbox command (migrate, relay, reconcile, status, list, show, retry, purge, consume, ...) on "
        "the database of settings.DATABASES[--database] (default: default), with ORBIT_URL, API_KEY, NAMESPACE "
        "and TABLE of settings.ORBIT as defaults. Everything after it is passed to orbit-outbox: "
        '"manage.py orbit_outbox relay --help" shows the relay\'s options (README "Django").'
    )

    def run_from_argv(self, argv: list[str]) -> None:
        args = argv[2:]
        using = "default"
        if args[:1] == ["--database"]:
            if len(args) < 2:
                sys.stderr.write("error: --database needs a DATABASES alias, e.g. --database default\n")
                sys.exit(2)
            using, args = args[1], args[2:]
        elif args and args[0].startswith("--database="):
            using, args = args[0].split("=", 1)[1], args[1:]
        if args[:1] in (["--help"], ["-h"]):
            self.print_help(argv[0], argv[1])
            args = ["--help"]
        try:
            self.execute(*args, using=using, prog=f"{os.path.basename(argv[0])} {argv[1]}")
        except CommandError as exc:
            sys.stderr.write(f"error: {exc}\n")
            sys.exit(2)

    def execute(self, *args: Any, **options: Any) -> None:
        from outbox_adapter.cli import main

        try:
            url = database_url(options.get("using", "default"))
        except Exception as exc:
            raise CommandError(f"--database: {exc}") from exc
        # The alias is what this command is for: it wins over an ORBIT_OUTBOX_DATABASE_URL in the environment.
        os.environ["ORBIT_OUTBOX_DATABASE_URL"] = url.render_as_string(hide_password=False)
        for key, env in _ENVIRONMENT.items():
            value = orbit_settings().get(key)
            if value is not None:
                os.environ.setdefault(env, str(value))
        main(args=list(args), prog_name=options.get("prog", "manage.py orbit_outbox"))

    def handle(self, *args: Any, **options: Any) -> None:  # pragma: no cover - execute() runs the command
        raise NotImplementedError
