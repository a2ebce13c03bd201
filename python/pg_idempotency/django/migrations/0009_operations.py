from django.db import migrations

from pg_idempotency.django.operations import ApplyBundledMigration


class Migration(migrations.Migration):
    dependencies = [("pg_idempotency", "0008_fenced_routes")]
    operations = [ApplyBundledMigration("0009_operations")]
