from django.db import migrations

from pg_idempotency.django.operations import ApplyBundledMigration


class Migration(migrations.Migration):
    dependencies = [("pg_idempotency", "0006_roles")]
    operations = [ApplyBundledMigration("0007_routes")]
