"""Harnesses, datasets, tasks and reward scripts moved to the catalog app: their tables and rows stay where they
are (`runs_harness`, ...); only Django's idea of which app owns them changes, so every operation here but the
help text is state only."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('catalog', '0001_move_catalog'),
        ('runs', '0010_model_call_constraint_choice'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(state_operations=[
                migrations.AlterField(
                    model_name='run',
                    name='dataset',
                    field=models.ForeignKey(null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='runs', to='catalog.dataset'),
                ),
                migrations.RemoveField(
                    model_name='task',
                    name='dataset',
                ),
                migrations.RemoveField(
                    model_name='harness',
                    name='owner',
                ),
                migrations.AlterField(
                    model_name='harnesscheck',
                    name='harness',
                    field=models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='checks', to='catalog.harness'),
                ),
                migrations.AlterField(
                    model_name='run',
                    name='harness',
                    field=models.ForeignKey(null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='runs', to='catalog.harness'),
                ),
                migrations.RemoveField(
                    model_name='rewardscript',
                    name='owner',
                ),
                migrations.AlterField(
                    model_name='harnesscheck',
                    name='reward_script',
                    field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='checks', to='catalog.rewardscript'),
                ),
                migrations.AlterField(
                    model_name='run',
                    name='reward_script',
                    field=models.ForeignKey(null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='runs', to='catalog.rewardscript'),
                ),
                migrations.AlterField(
                    model_name='rollout',
                    name='task',
                    field=models.ForeignKey(null=True, on_delete=django.db.models.deletion.SET_NULL, related_name='rollouts', to='catalog.task'),
                ),
                migrations.DeleteModel(
                    name='Dataset',
                ),
                migrations.DeleteModel(
                    name='Harness',
                ),
                migrations.DeleteModel(
                    name='RewardScript',
                ),
                migrations.DeleteModel(
                    name='Task',
                ),
        ]),
        migrations.AlterField(
            model_name='run',
            name='isolation',
            field=models.CharField(blank=True, help_text="How its user code was isolated (sandbox.isolation), set when a worker starts it, e.g. 'bubblewrap 0.11.0: harnesses reach only the proxy, ...' or 'none (LIGHTNING_UNSAFE_LOCAL_EXEC=1)'", max_length=300),
        ),
    ]
