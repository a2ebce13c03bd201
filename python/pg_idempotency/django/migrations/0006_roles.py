from django.db import migrations

from pg_idempotency.django.operations import ApplyBundledMigration


class Migration(migrations.Migration):
    dependencies = [("pg_idempotency", "0005_directory")]
    operations = [ApplyBundledMigration("0006_roles")]
