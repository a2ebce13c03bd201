"""``"pg_idempotency.django"`` in ``INSTALLED_APPS``: its migrations install the schema."""

from django.apps import AppConfig


class PgIdempotencyConfig(AppConfig):
    name = "pg_idempotency.django"
    label = "pg_idempotency"
    verbose_name = "pg_idempotency"
