from django.db import migrations

from pg_idempotency.django.operations import ApplyBundledMigration


class Migration(migrations.Migration):
    dependencies = [("pg_idempotency", "0013_bounded_inputs")]
    operations = [ApplyBundledMigration("0014_citus_delegation")]
