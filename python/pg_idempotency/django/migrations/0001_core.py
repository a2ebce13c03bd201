from django.db import migrations

from pg_idempotency.django.operations import ApplyBundledMigration


class Migration(migrations.Migration):
    dependencies = []
    operations = [ApplyBundledMigration("0001_core")]
