"""Tables of what a user defines before a run: harnesses, datasets and their tasks, reward scripts.

The tables kept their names from when they lived in the runs app (`runs_harness`, ...): migrations moved the models,
not the rows. Methods here only read their own row; writes live in catalog/services.py."""
from __future__ import annotations

from django.conf import settings
from django.db import models

from catalog.datasets import hidden_fields


class Executor(models.TextChoices):
    LOCAL = "local", "Local subprocess"
    KUBERNETES = "kubernetes", "Kubernetes Job"


class Split(models.TextChoices):
    TRAIN = "train", "Train"
    VAL = "val", "Validation"


class Owned(models.Model):
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        abstract = True


class Harness(Owned):
    """The command that runs an agent on one task; `{placeholders}` are filled per rollout."""

    name = models.CharField(max_length=200)
    description = models.TextField(blank=True)
    command = models.JSONField(help_text="argv list, e.g. ['python', 'agent.py', '{task_file}']")
    env = models.JSONField(default=dict, blank=True)
    executor = models.CharField(max_length=20, choices=Executor.choices, default=Executor.LOCAL)
    image = models.CharField(max_length=500, blank=True)
    resources = models.JSONField(default=dict, blank=True)
    timeout_s = models.PositiveIntegerField(default=600)
    version = models.PositiveIntegerField(default=1)

    class Meta:
        db_table = "runs_harness"
        constraints = [models.UniqueConstraint(fields=["owner", "name"], name="harness_owner_name")]
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return self.name


class Dataset(Owned):
    """A set of tasks uploaded as JSONL or JSON, split into train and val."""

    name = models.CharField(max_length=200)
    description = models.TextField(blank=True)
    version = models.PositiveIntegerField(default=1)
    source_filename = models.CharField(max_length=500, blank=True)
    content_sha256 = models.CharField(max_length=64, blank=True)
    split_field = models.CharField(max_length=100, blank=True)
    val_ratio = models.FloatField(default=0.0)
    seed = models.IntegerField(default=0)
    train_count = models.PositiveIntegerField(default=0)
    val_count = models.PositiveIntegerField(default=0)
    hidden_fields = models.JSONField(
        default=list, blank=True,
        help_text="Reward-only task fields beyond the defaults (answer, expected, solution, tests): "
                  "never shown to a harness")

    class Meta:
        db_table = "runs_dataset"
        constraints = [models.UniqueConstraint(fields=["owner", "name"], name="dataset_owner_name")]
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return self.name

    @property
    def reward_only_fields(self) -> list[str]:
        """Every field the harness never sees: the defaults and this dataset's own hidden fields."""
        return hidden_fields(self.hidden_fields)


class Task(models.Model):
    dataset = models.ForeignKey(Dataset, on_delete=models.CASCADE, related_name="tasks")
    index = models.PositiveIntegerField(help_text="Position in the uploaded file, from 0")
    external_id = models.CharField(max_length=200)
    split = models.CharField(max_length=10, choices=Split.choices)
    data = models.JSONField()

    class Meta:
        db_table = "runs_task"
        constraints = [models.UniqueConstraint(fields=["dataset", "external_id"], name="task_dataset_external_id")]
        indexes = [models.Index(fields=["dataset", "split", "index"], name="task_dataset_split_index")]
        ordering = ["dataset", "index"]

    def __str__(self) -> str:
        return f"{self.dataset_id}:{self.external_id}"


class RewardScript(Owned):
    """Python source defining reward(task, outcome) -> float | {"reward": float, ...}."""

    name = models.CharField(max_length=200)
    description = models.TextField(blank=True)
    source = models.TextField()
    timeout_s = models.PositiveIntegerField(default=10)
    version = models.PositiveIntegerField(default=1)

    class Meta:
        db_table = "runs_rewardscript"
        constraints = [models.UniqueConstraint(fields=["owner", "name"], name="reward_owner_name")]
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return self.name
