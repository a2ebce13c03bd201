from django.db import migrations

from pg_idempotency.django.operations import ApplyBundledMigration


class Migration(migrations.Migration):
    dependencies = [("pg_idempotency", "0007_routes")]
    operations = [ApplyBundledMigration("0008_fenced_routes")]
