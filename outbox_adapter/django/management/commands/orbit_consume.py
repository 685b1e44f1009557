"""``python manage.py orbit_consume --subscription NAME --handler app.module:apply``: apply Orbit's
result events through the ORM, each in one atomic block with its inbox row (README "Django")."""

from __future__ import annotations

import os
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from orbit_client import OrbitClient
from outbox_adapter._exceptions import OutboxError
from outbox_adapter.django._settings import orbit_settings


class Command(BaseCommand):
    help = (
        "Apply the result events of an Orbit subscription with a Django handler, handler(event), that uses the ORM "
        "inside the same transaction.atomic() as the event's inbox row, so the business update and the inbox entry "
        "commit together and a redelivered event changes nothing; until SIGTERM (or, with --once, until nothing is "
        'due). Acks only after the commit (README "Django").'
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--subscription", required=True, help="The Orbit subscription to consume.")
        parser.add_argument(
            "--handler", required=True, metavar="MODULE:FUNCTION",
            help="handler(event) applying one orbit_client.ResultEvent through the ORM, e.g. shop.results:apply.",
        )  # fmt: skip
        parser.add_argument(
            "--database", default="default", help="The DATABASES alias holding the inbox table."
        )
        parser.add_argument(
            "--namespace", default=None, help="The Orbit namespace (default: settings.ORBIT['NAMESPACE'])."
        )
        parser.add_argument(
            "--orbit-url", default=None, help="Orbit's URL (default: $ORBIT_URL, else ORBIT['ORBIT_URL'])."
        )
        parser.add_argument(
            "--api-key", default=None, help="A work key (default: $ORBIT_API_KEY, else ORBIT['API_KEY'])."
        )
        parser.add_argument("--once", action="store_true", help="Handle what is due now, then exit.")
        parser.add_argument(
            "--batch-size", type=int, default=10, help="Deliveries leased at once (default 10)."
        )
        parser.add_argument(
            "--lease-seconds", type=float, default=30.0, help="Lease of each delivery (default 30)."
        )
        parser.add_argument(
            "--max-deliveries", type=int, default=10,
            help="Deliveries after which an event whose handler still fails is recorded FAILED and acked (0: never).",
        )  # fmt: skip

    def handle(self, *args: Any, **options: Any) -> None:
        from outbox_adapter.cli import load_handler
        from outbox_adapter.django.consumer import DjangoResultConsumer

        orbit = orbit_settings()
        namespace = options["namespace"] or orbit.get("NAMESPACE")
        url = options["orbit_url"] or os.environ.get("ORBIT_URL") or orbit.get("ORBIT_URL")
        key = options["api_key"] or os.environ.get("ORBIT_API_KEY") or orbit.get("API_KEY")
        for value, option, setting in ((namespace, "--namespace", "NAMESPACE"), (url, "--orbit-url", "ORBIT_URL"),
                                       (key, "--api-key", "API_KEY")):  # fmt: skip
            if not value:
                raise CommandError(
                    f"{option} is needed: pass it, or set ORBIT['{setting}'] in the Django settings"
                )
        try:
            handler = load_handler(options["handler"])
        except OutboxError as exc:
            raise CommandError(str(exc)) from exc
        max_deliveries = options["max_deliveries"] or None
        with OrbitClient(str(url), api_key=str(key)) as client:
            try:
                consumer = DjangoResultConsumer(
                    client, str(namespace), options["subscription"], handler,  # type: ignore[arg-type]
                    using=options["database"], batch_size=options["batch_size"],
                    lease_seconds=options["lease_seconds"], max_deliveries=max_deliveries,
                    install_signal_handlers=True,
                )  # fmt: skip
            except OutboxError as exc:
                raise CommandError(str(exc)) from exc
            with consumer:
                stats = consumer.run(once=options["once"])
        self.stdout.write(
            f"orbit_consume: {stats.applied} applied, {stats.duplicates} duplicates, {stats.failed} failed, "
            f"{stats.parked} parked"
        )
