from django.db import migrations

from pg_idempotency.django.operations import ApplyBundledMigration


class Migration(migrations.Migration):
    dependencies = [("pg_idempotency", "0012_bounded_canonical")]
    operations = [ApplyBundledMigration("0013_bounded_inputs")]
