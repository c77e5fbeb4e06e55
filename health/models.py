"""Tables of run health: one RunAlarm per (run, kind, step), and re-scorings with their per-rollout results.

Writes live in health/services.py and health/rescoring.py; nothing here touches a run's own record."""
from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import F, Q
from django.db.models.functions import Abs

from catalog.models import RewardScript
from runs.models import Rollout, Run


class AlarmKind(models.TextChoices):
    NO_TOOL_CALLS = "no_tool_calls", "No tool calls"
    UNPARSED_TOOL_TEXT = "unparsed_tool_text", "Tool calls as text"
    EMPTY_ROLLOUTS = "empty_rollouts", "Empty rollouts"
    NO_SIGNAL = "no_signal", "Groups without signal"
    LOGPROB_MISMATCH = "logprob_mismatch", "Train/engine logprob mismatch"
    REWARD_UP_VAL_DOWN = "reward_up_val_down", "Reward up, validation down"
    TRUNCATION_RISING = "truncation_rising", "Truncations or timeouts rising"
    REWARD_COLLAPSE = "reward_collapse", "Reward collapse"
    REWARD_HACKING = "reward_hacking", "Possible reward hacking"


class Severity(models.TextChoices):
    WARNING = "warning", "Warning"
    CRITICAL = "critical", "Critical"


class RunAlarm(models.Model):
    """What one step of a run showed that a healthy run does not, with the figures that show it."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="alarms")
    step = models.PositiveIntegerField(help_text="The training step whose records raised it")
    kind = models.CharField(max_length=40, choices=AlarmKind.choices)
    severity = models.CharField(max_length=10, choices=Severity.choices, default=Severity.WARNING)
    message = models.TextField(help_text="What was seen and what to check, in one or two sentences")
    evidence = models.JSONField(default=dict, help_text="The figures the rule compared with its thresholds")
    rollout_ids = models.JSONField(default=list, help_text="Up to 5 example rollouts that show it")
    created_at = models.DateTimeField(auto_now_add=True)
    acknowledged_at = models.DateTimeField(null=True, blank=True)
    acknowledged_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                        related_name="+")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "kind", "step"], name="alarm_run_kind_step")]
        indexes = [models.Index(fields=["run", "step"], name="alarm_run_step")]
        ordering = ["run", "step", "kind"]

    def __str__(self) -> str:
        return f"run {self.run_id} step {self.step}: {self.kind}"


class RescoreScope(models.TextChoices):
    ALL = "all", "Every finished rollout"
    STEP = "step", "The rollouts of one step"
    FLAGGED = "flagged", "The rollouts the reward-hacking lens flagged"


class RescoreStatus(models.TextChoices):
    QUEUED = "queued", "Queued"
    RUNNING = "running", "Running"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"


class Rescore(models.Model):
    """A run's stored rollouts scored again with a reward script (a snapshot of it): the run's record is untouched."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="rescores")
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    reward_script = models.ForeignKey(RewardScript, null=True, on_delete=models.SET_NULL, related_name="+")
    reward_snapshot = models.JSONField(default=dict, help_text="name, version, source and timeout_s as scored")
    scope = models.CharField(max_length=10, choices=RescoreScope.choices, default=RescoreScope.ALL)
    step = models.PositiveIntegerField(null=True, blank=True, help_text="The step of scope=step")
    status = models.CharField(max_length=10, choices=RescoreStatus.choices, default=RescoreStatus.QUEUED)
    total = models.PositiveIntegerField(default=0)
    done = models.PositiveIntegerField(default=0)
    summary = models.JSONField(default=dict, help_text="Changed rewards and Pass@1 before and after, per split")
    error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"rescore {self.pk} of run {self.run_id}"


CHANGE_EPS = 1e-9
"""Rewards closer than this are the same reward (floats from two runs of one script)."""


class RescoredQuerySet(models.QuerySet):
    def changed(self) -> "RescoredQuerySet":
        """The results whose reward changed (RescoredRollout.changed), filtered in SQL."""
        return self.filter(error="").annotate(change=Abs(F("new_reward") - F("old_reward"))).filter(
            Q(old_reward__isnull=True) | Q(change__gt=CHANGE_EPS))


class RescoredRollout(models.Model):
    objects = RescoredQuerySet.as_manager()

    rescore = models.ForeignKey(Rescore, on_delete=models.CASCADE, related_name="results")
    rollout = models.ForeignKey(Rollout, on_delete=models.CASCADE, related_name="+")
    old_reward = models.FloatField(null=True, blank=True)
    new_reward = models.FloatField(null=True, blank=True)
    detail = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["rescore", "rollout"], name="rescored_once")]
        ordering = ["rescore", "rollout"]

    @property
    def changed(self) -> bool:
        """Scored, and its new reward differs from the run's (a rollout the run never rewarded counts as changed)."""
        return not self.error and (self.old_reward is None or abs((self.new_reward or 0.0) - self.old_reward)
                                   > CHANGE_EPS)
