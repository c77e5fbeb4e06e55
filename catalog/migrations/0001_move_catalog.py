"""The catalog's models as they were in the runs app, on the same tables (`db_table`): created in Django's state only,
since runs' migrations 0001 to 0010 made the tables and hold the rows. Content types and permissions follow them."""

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


MOVED = ("harness", "dataset", "task", "rewardscript")


def move_content_types(apps, schema_editor, src="runs", dst="catalog"):
    """Admin log entries and permissions point at content types: relabel the moved models' rows, not new ones."""
    ContentType = apps.get_model("contenttypes", "ContentType")
    ContentType.objects.using(schema_editor.connection.alias).filter(app_label=dst, model__in=MOVED).delete()
    ContentType.objects.using(schema_editor.connection.alias).filter(app_label=src, model__in=MOVED).update(app_label=dst)


def move_content_types_back(apps, schema_editor):
    move_content_types(apps, schema_editor, src="catalog", dst="runs")


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
        ("contenttypes", "0002_remove_content_type_name"),
        ("runs", "0010_model_call_constraint_choice"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(state_operations=[
                migrations.CreateModel(
                    name='Dataset',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('created_at', models.DateTimeField(auto_now_add=True)),
                        ('updated_at', models.DateTimeField(auto_now=True)),
                        ('name', models.CharField(max_length=200)),
                        ('description', models.TextField(blank=True)),
                        ('version', models.PositiveIntegerField(default=1)),
                        ('source_filename', models.CharField(blank=True, max_length=500)),
                        ('content_sha256', models.CharField(blank=True, max_length=64)),
                        ('split_field', models.CharField(blank=True, max_length=100)),
                        ('val_ratio', models.FloatField(default=0.0)),
                        ('seed', models.IntegerField(default=0)),
                        ('train_count', models.PositiveIntegerField(default=0)),
                        ('val_count', models.PositiveIntegerField(default=0)),
                        ('hidden_fields', models.JSONField(blank=True, default=list, help_text='Reward-only task fields beyond the defaults (answer, expected, solution, tests): never shown to a harness')),
                        ('owner', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='+', to=settings.AUTH_USER_MODEL)),
                    ],
                    options={
                        'db_table': 'runs_dataset',
                        'ordering': ['-created_at'],
                    },
                ),
                migrations.CreateModel(
                    name='Harness',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('created_at', models.DateTimeField(auto_now_add=True)),
                        ('updated_at', models.DateTimeField(auto_now=True)),
                        ('name', models.CharField(max_length=200)),
                        ('description', models.TextField(blank=True)),
                        ('command', models.JSONField(help_text="argv list, e.g. ['python', 'agent.py', '{task_file}']")),
                        ('env', models.JSONField(blank=True, default=dict)),
                        ('executor', models.CharField(choices=[('local', 'Local subprocess'), ('kubernetes', 'Kubernetes Job')], default='local', max_length=20)),
                        ('image', models.CharField(blank=True, max_length=500)),
                        ('resources', models.JSONField(blank=True, default=dict)),
                        ('timeout_s', models.PositiveIntegerField(default=600)),
                        ('version', models.PositiveIntegerField(default=1)),
                        ('owner', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='+', to=settings.AUTH_USER_MODEL)),
                    ],
                    options={
                        'db_table': 'runs_harness',
                        'ordering': ['-created_at'],
                    },
                ),
                migrations.CreateModel(
                    name='RewardScript',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('created_at', models.DateTimeField(auto_now_add=True)),
                        ('updated_at', models.DateTimeField(auto_now=True)),
                        ('name', models.CharField(max_length=200)),
                        ('description', models.TextField(blank=True)),
                        ('source', models.TextField()),
                        ('timeout_s', models.PositiveIntegerField(default=10)),
                        ('version', models.PositiveIntegerField(default=1)),
                        ('owner', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='+', to=settings.AUTH_USER_MODEL)),
                    ],
                    options={
                        'db_table': 'runs_rewardscript',
                        'ordering': ['-created_at'],
                    },
                ),
                migrations.CreateModel(
                    name='Task',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('index', models.PositiveIntegerField(help_text='Position in the uploaded file, from 0')),
                        ('external_id', models.CharField(max_length=200)),
                        ('split', models.CharField(choices=[('train', 'Train'), ('val', 'Validation')], max_length=10)),
                        ('data', models.JSONField()),
                        ('dataset', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='tasks', to='catalog.dataset')),
                    ],
                    options={
                        'db_table': 'runs_task',
                        'ordering': ['dataset', 'index'],
                    },
                ),
                migrations.AddConstraint(
                    model_name='dataset',
                    constraint=models.UniqueConstraint(fields=('owner', 'name'), name='dataset_owner_name'),
                ),
                migrations.AddConstraint(
                    model_name='harness',
                    constraint=models.UniqueConstraint(fields=('owner', 'name'), name='harness_owner_name'),
                ),
                migrations.AddConstraint(
                    model_name='rewardscript',
                    constraint=models.UniqueConstraint(fields=('owner', 'name'), name='reward_owner_name'),
                ),
                migrations.AddIndex(
                    model_name='task',
                    index=models.Index(fields=['dataset', 'split', 'index'], name='task_dataset_split_index'),
                ),
                migrations.AddConstraint(
                    model_name='task',
                    constraint=models.UniqueConstraint(fields=('dataset', 'external_id'), name='task_dataset_external_id'),
                ),
        ]),
        migrations.RunPython(move_content_types, move_content_types_back),
    ]
