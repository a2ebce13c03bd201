from django.db import migrations

from pg_idempotency.django.operations import ApplyBundledMigration


class Migration(migrations.Migration):
    dependencies = [("pg_idempotency", "0004_hardening")]
    operations = [ApplyBundledMigration("0005_directory")]
