from django.db import migrations

from pg_idempotency.django.operations import ApplyBundledMigration


class Migration(migrations.Migration):
    dependencies: list[tuple[str, str]] = []
    operations = [ApplyBundledMigration("0001_core")]
