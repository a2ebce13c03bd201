from django.db import migrations

from pg_idempotency.django.operations import ApplyBundledMigration


class Migration(migrations.Migration):
    dependencies = [("pg_idempotency", "0011_hot_path")]
    operations = [ApplyBundledMigration("0012_bounded_canonical")]
