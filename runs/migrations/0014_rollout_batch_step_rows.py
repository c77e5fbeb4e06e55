"""The rows of 0013: trained_step held the step of a rollout's batch, trained or dropped; that is batch_step now.
A migration of its own: PostgreSQL refuses DDL on a table with row updates pending in the same transaction."""

from django.db import migrations, models


def split_trained_step(apps, schema_editor):
    """trained_step held the step of a rollout's batch, trained or dropped: that is batch_step now, and trained_step
    stays only where the step trained on it."""
    Rollout = apps.get_model("runs", "Rollout")
    Rollout.objects.filter(trained_step__isnull=False).update(batch_step=models.F("trained_step"))
    Rollout.objects.exclude(drop_reason="").update(trained_step=None)


def join_trained_step(apps, schema_editor):
    Rollout = apps.get_model("runs", "Rollout")
    Rollout.objects.filter(batch_step__isnull=False).update(trained_step=models.F("batch_step"))


class Migration(migrations.Migration):

    dependencies = [
        ('runs', '0013_rollout_batch_step'),
    ]

    operations = [
        migrations.RunPython(split_trained_step, join_trained_step),
    ]
