from django.db import migrations

from pg_idempotency.django.operations import ApplyBundledMigration


class Migration(migrations.Migration):
    dependencies = [("pg_idempotency", "0009_citus")]
    operations = [ApplyBundledMigration("0010_operations")]
