from django.db import migrations

from pg_idempotency.django.operations import ApplyBundledMigration


class Migration(migrations.Migration):
    dependencies = [("pg_idempotency", "0003_accept")]
    operations = [ApplyBundledMigration("0004_hardening")]
