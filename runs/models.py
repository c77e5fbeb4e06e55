"""Tables of the domain; methods here only read their own row. Writes live in runs/services.py."""
from __future__ import annotations

from django.db import models

from catalog.datasets import harness_view, hidden_fields
from catalog.models import Dataset, Harness, Owned, RewardScript, Split, Task


class RunStatus(models.TextChoices):
    QUEUED = "queued", "Queued"
    STARTING = "starting", "Starting"
    RUNNING = "running", "Running"
    CANCELLING = "cancelling", "Cancelling"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"


FINISHED_RUN_STATUSES = frozenset({RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED})
"""A run in one of these has ended: no worker holds it."""


class RolloutStatus(models.TextChoices):
    PENDING = "pending", "Pending"
    RUNNING = "running", "Running"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"
    LOST = "lost", "Lost"
    """Its worker died mid-step: the resumed run does not train on it (its recorded calls are kept)."""


class CallApi(models.TextChoices):
    CHAT = "chat", "Chat Completions"
    COMPLETIONS = "completions", "Completions"
    RESPONSES = "responses", "Responses"
    MESSAGES = "messages", "Anthropic Messages"


class Drift(models.TextChoices):
    NONE = "", "Not classified"
    CLEAN = "clean", "Clean"
    REALIGN = "realign", "Realign"
    FORK = "fork", "Fork"


class FailureKind(models.TextChoices):
    """Whose fault a failed rollout was: the policy's is trained on, the infrastructure's is left out."""

    NONE = "", "Not failed"
    POLICY = "policy", "Policy"
    INFRA = "infra", "Infrastructure"


class SampleBuild(models.TextChoices):
    SINGLE = "single", "One call"
    MERGED = "merged", "Clean appends merged"
    REALIGNED = "realigned", "Realigned splice"


class SortIndex(models.Index):
    """An index on ORDER BY terms, NULLS LAST included where the database stores it.

    SQLite refuses NULLS FIRST/LAST in CREATE INDEX; NULL sorts lowest there, so its plain DESC already puts NULL
    last: it gets the terms without them.
    """

    def create_sql(self, model, schema_editor, using="", **kwargs):
        if schema_editor.connection.vendor != "sqlite":
            return super().create_sql(model, schema_editor, using=using, **kwargs)
        plain = [models.OrderBy(term.expression, descending=term.descending) if isinstance(term, models.OrderBy)
                 else term for term in self.expressions]
        return models.Index(*plain, name=self.name, condition=self.condition, include=self.include,
                            db_tablespace=self.db_tablespace).create_sql(model, schema_editor, using=using, **kwargs)


class Run(Owned):
    name = models.CharField(max_length=200)
    model = models.CharField(max_length=500, help_text="Registry name, model folder, or external engine URL")
    model_info = models.JSONField(default=dict, help_text="The model as resolved at creation: path, origin, size")
    config = models.JSONField(default=dict, help_text="TrainerConfig.to_dict()")
    harness = models.ForeignKey(Harness, null=True, on_delete=models.SET_NULL, related_name="runs")
    dataset = models.ForeignKey(Dataset, null=True, on_delete=models.SET_NULL, related_name="runs")
    reward_script = models.ForeignKey(RewardScript, null=True, on_delete=models.SET_NULL, related_name="runs")
    harness_snapshot = models.JSONField(default=dict)
    dataset_snapshot = models.JSONField(default=dict)
    reward_snapshot = models.JSONField(default=dict)
    cloned_from = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="clones")
    status = models.CharField(max_length=20, choices=RunStatus.choices, default=RunStatus.QUEUED)
    step = models.PositiveIntegerField(default=0)
    policy_version = models.PositiveIntegerField(default=0)
    error = models.TextField(blank=True)
    checkpoint_path = models.CharField(max_length=1000, blank=True)
    celery_task_id = models.CharField(max_length=200, blank=True)
    heartbeat_at = models.DateTimeField(
        null=True, blank=True, help_text="Last sign of life from the worker running it; the sweep reclaims stale runs")
    worker_starts = models.PositiveIntegerField(
        default=0, help_text="Times a worker took the run up: 1 for a run never interrupted or resumed")
    phase = models.CharField(max_length=300, blank=True,
                             help_text="What the run is doing now, e.g. 'starting the engine: loading weights'")
    event_seq = models.PositiveBigIntegerField(default=0, help_text="Last RunEvent.seq issued")
    isolation = models.CharField(max_length=300, blank=True, help_text=(
        "How its user code was isolated (sandbox.isolation), set when a worker starts it, e.g. 'bubblewrap 0.11.0: "
        "harnesses reach only the proxy, ...' or 'none (LIGHTNING_UNSAFE_LOCAL_EXEC=1)'"))
    host = models.JSONField(default=dict, blank=True, help_text=(
        "The host its worker runs it on and the number formats chosen there (trainer.host), set when a worker "
        "starts it: the CPU profile, {'formats': {'engine_dtype', 'trainer_dtype', 'reason'}} and a 'summary' line"))
    pool = models.CharField(max_length=100, default="default", db_index=True, help_text=(
        "The worker pool that runs it: a Celery queue ('pool-<name>') served by the workers started for that pool"))
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["owner", "status"], name="run_owner_status")]

    def __str__(self) -> str:
        return f"{self.name} ({self.status})"

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED_RUN_STATUSES

    def harness_task(self, data: dict) -> dict:
        """The task as this run's harness may see it: the reward-only fields of its dataset snapshot left out.

        Runs snapshotted before datasets had hidden fields still hide the defaults.
        """
        return harness_view(data, hidden_fields(self.dataset_snapshot.get("hidden_fields", ())))


class Rollout(models.Model):
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="rollouts")
    task = models.ForeignKey(Task, null=True, on_delete=models.SET_NULL, related_name="rollouts")
    split = models.CharField(max_length=10, choices=Split.choices, default=Split.TRAIN)
    step = models.PositiveIntegerField(default=0)
    group = models.PositiveIntegerField(default=0)
    attempt = models.PositiveIntegerField(default=0)
    greedy = models.BooleanField(default=False, help_text="An evaluation attempt at temperature 0 (eval_greedy)")
    policy_version = models.PositiveIntegerField(default=0)
    status = models.CharField(max_length=20, choices=RolloutStatus.choices, default=RolloutStatus.PENDING)
    reward = models.FloatField(null=True, blank=True)
    reward_detail = models.JSONField(default=dict, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    stdout_tail = models.TextField(blank=True)
    stderr_tail = models.TextField(blank=True)
    error = models.TextField(blank=True)
    failure_kind = models.CharField(
        max_length=16, choices=FailureKind.choices, default=FailureKind.NONE, blank=True,
        help_text="policy: the harness timed out, ended without an answer or exited non-zero after the model had "
                  "answered (trained with failure_reward); infra: engine or proxy errors, a killed worker, a crashed "
                  "reward script (left out of the loss and the baseline)")
    secret_hash = models.CharField(max_length=64, blank=True, help_text="sha256 of the rollout's API key")
    call_count = models.PositiveIntegerField(default=0)
    batch_step = models.PositiveIntegerField(
        null=True, blank=True, help_text="The training step it was sampled for: the step whose batch trained it or "
                                         "dropped it (drop_reason); null before its step, and for evaluations")
    trained_step = models.PositiveIntegerField(
        null=True, blank=True, help_text="The training step that trained on it; null when its step dropped it")
    drop_reason = models.CharField(
        max_length=500, blank=True,
        help_text="Why the rollout gave its step no trained sample ('infra_failure: ...', 'no_sampled_tokens', "
                  "'no_signal: ...' for a group dynamic sampling dropped); '' when trained or not yet in a step")
    outcome = models.JSONField(
        default=dict, blank=True, db_default={},
        help_text="What the harness wrote to its output file, as the reward script got it (health.rescoring scores "
                  "it again); {'_not_stored': reason} when it was over OUTCOME_LIMIT_BYTES")
    flags = models.JSONField(
        default=list, blank=True, db_default=[],
        help_text="The reward-hacking lens's findings (health.audit): [{'kind': ..., 'evidence': ...}], [] if none")
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["run", "step", "group", "attempt", "id"]
        indexes = [
            models.Index(fields=["run", "step"], name="rollout_run_step"),
            models.Index(fields=["run", "batch_step", "group", "attempt"], name="rollout_run_batch_step"),
            models.Index(fields=["run", "split", "status"], name="rollout_run_split_status"),
            # The run page's rollouts table (dashboard.rollout_queries.SORTS) reads a page straight from these in every
            # order but ascending duration: newest/oldest, reward, -reward, calls/-calls (one index both ways:
            # call_count is never NULL), -duration.
            models.Index(fields=["run", "id"], name="rollout_run_id"),
            models.Index(fields=["run", "reward", "id"], name="rollout_run_reward"),
            SortIndex(models.F("run"), models.F("reward").desc(nulls_last=True), models.F("id").desc(),
                      name="rollout_run_reward_desc"),
            models.Index(fields=["run", "-call_count", "-id"], name="rollout_run_calls"),
            SortIndex(models.F("run"), (models.F("finished_at") - models.F("started_at")).desc(nulls_last=True),
                      models.F("id").desc(), name="rollout_run_duration_desc"),
            # Only the rollouts that failed with a message: a text search of errors that says ~Q(error="") reads
            # these instead of every rollout of the run.
            models.Index(fields=["run", "id"], condition=~models.Q(error=""), name="rollout_run_errored"),
        ]

    def __str__(self) -> str:
        return f"rollout {self.pk} of run {self.run_id}"

    @property
    def is_finished(self) -> bool:
        return self.status in (RolloutStatus.SUCCEEDED, RolloutStatus.FAILED, RolloutStatus.CANCELLED,
                               RolloutStatus.LOST)

    @property
    def fate(self) -> str:
        """What its training step did with it, in words: 'sampled for step 3: trained', '...: dropped (why)';
        '' before its step, and for evaluations."""
        if self.batch_step is None:
            return ""
        what = "trained" if self.trained_step is not None else f"dropped ({self.drop_reason or 'not trained'})"
        return f"sampled for step {self.batch_step}: {what}"


class ModelCall(models.Model):
    rollout = models.ForeignKey(Rollout, on_delete=models.CASCADE, related_name="calls")
    seq = models.PositiveIntegerField()
    api = models.CharField(max_length=20, choices=CallApi.choices)
    stream = models.BooleanField(default=False)
    request = models.JSONField()
    response = models.JSONField(null=True, blank=True)
    prompt_ids = models.JSONField(default=list)
    completion_ids = models.JSONField(default=list)
    logprobs = models.JSONField(default=list)
    finish_reason = models.CharField(max_length=50, blank=True)
    status_code = models.PositiveSmallIntegerField()
    latency_ms = models.FloatField(default=0.0)
    policy_version = models.PositiveIntegerField(default=0)
    drift = models.CharField(max_length=10, choices=Drift.choices, default=Drift.NONE, blank=True)
    sampling_overrides = models.JSONField(
        default=dict, blank=True, help_text="Sampling parameters the harness asked for that the proxy overrode")
    replica = models.PositiveSmallIntegerField(
        null=True, blank=True, help_text="Index of the engine replica that answered (None: a run with one engine)")
    retried = models.BooleanField(
        default=False, help_text="The call's first replica died mid-call and another replica answered it")
    choice = models.PositiveSmallIntegerField(default=0, db_default=0, help_text=(
        "Which choice of a call that asked for n > 1 this record holds (choice k of the call at seq s has seq s + k); "
        "0 for a call of one choice"))
    constraint = models.CharField(max_length=100, blank=True, default="", db_default="", help_text=(
        "What constrained the engine's decoding of this call ('response_format json_schema', 'tool_choice "
        "required', ...; proxy.sampling.constraint_of): its tokens were forced, not sampled, and are not trained"))
    error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["rollout", "seq"]
        constraints = [models.UniqueConstraint(fields=["rollout", "seq"], name="call_rollout_seq")]

    def __str__(self) -> str:
        return f"call {self.seq} of rollout {self.rollout_id}"


class Sample(models.Model):
    rollout = models.ForeignKey(Rollout, on_delete=models.CASCADE, related_name="samples")
    index = models.PositiveIntegerField(default=0)
    token_ids = models.JSONField(default=list)
    loss_mask = models.JSONField(default=list)
    logprobs = models.JSONField(default=list, help_text="Behaviour logprobs aligned to token_ids")
    trainer_logprobs = models.JSONField(
        default=list, blank=True,
        help_text="The trainer's logprob of each trained token before the step's update, aligned to token_ids "
                  "(null where the token is not a loss token); [] where not recorded")
    advantage = models.FloatField(default=0.0)
    call_seqs = models.JSONField(default=list, help_text="Seqs of the calls merged into this sample")
    spans = models.JSONField(
        default=list, blank=True,
        help_text="[call_seq, start, end, sampled] of each token span: which call it came from, prompt or sampled; "
                  "[] for samples recorded before spans were")
    step = models.PositiveIntegerField(null=True, blank=True, help_text="The training step that trained it")
    build = models.CharField(max_length=10, choices=SampleBuild.choices, default=SampleBuild.SINGLE)
    policy_version = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["rollout", "index"]
        constraints = [models.UniqueConstraint(fields=["rollout", "index"], name="sample_rollout_index")]


class Metric(models.Model):
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="metrics")
    step = models.PositiveIntegerField()
    name = models.CharField(max_length=100)
    value = models.FloatField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["run", "step", "name"]
        constraints = [models.UniqueConstraint(fields=["run", "step", "name"], name="metric_run_step_name")]
        indexes = [
            models.Index(fields=["run", "step"], name="metric_run_step"),
            models.Index(fields=["run", "name", "step"], name="metric_run_name_step"),
        ]


class RunEvent(models.Model):
    """Source of truth for live updates: a client replays the events after the last seq it saw."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="events")
    seq = models.PositiveBigIntegerField()
    kind = models.CharField(max_length=50)
    payload = models.JSONField(default=dict)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["run", "seq"]
        constraints = [models.UniqueConstraint(fields=["run", "seq"], name="event_run_seq")]


class CheckStatus(models.TextChoices):
    QUEUED = "queued", "Queued"
    RUNNING = "running", "Running"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"
    """The check itself could not run (a missing tokenizer, a crash); a harness that fails gets a report instead."""


class CheckEngine(models.TextChoices):
    SCRIPTED = "scripted", "Scripted engine"
    """Deterministic answers (proxy.scripted_engine) rendered with the chosen model's own tokenizer and template."""
    VLLM = "vllm", "The model on vLLM"
    """The chosen model's own answers, served by vLLM as a run serves it (minutes to start; on the runs worker)."""


class HarnessCheck(Owned):
    """One run of a harness on one task through the proxy, before a real run: what was recorded and trained."""

    harness = models.ForeignKey(Harness, on_delete=models.CASCADE, related_name="checks")
    harness_version = models.PositiveIntegerField(help_text="The harness version the check ran")
    task = models.JSONField(help_text="The full task: the harness sees it without its reward-only fields")
    task_source = models.JSONField(
        default=dict, blank=True,
        help_text='Where the task came from: {"dataset": id, "dataset_name", "task_id"} or {"typed": true}, with '
                  'the "hidden_fields" the harness does not see')
    reward_script = models.ForeignKey(RewardScript, null=True, blank=True, on_delete=models.SET_NULL,
                                      related_name="checks")
    engine = models.CharField(max_length=20, choices=CheckEngine.choices, default=CheckEngine.SCRIPTED)
    model = models.CharField(max_length=500, help_text="Registry model whose tokenizer renders prompts and answers")
    status = models.CharField(max_length=20, choices=CheckStatus.choices, default=CheckStatus.QUEUED)
    report = models.JSONField(default=dict, blank=True, help_text="runs.harness_check CheckResult.report()")
    error = models.TextField(blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["harness", "-created_at"], name="check_harness_created")]

    def __str__(self) -> str:
        return f"check {self.pk} of harness {self.harness_id} ({self.status})"

    @property
    def is_finished(self) -> bool:
        return self.status in (CheckStatus.SUCCEEDED, CheckStatus.FAILED)

    @property
    def reward_only_fields(self) -> list[str]:
        """The task's fields the harness does not see (recorded with its source; the defaults for older rows)."""
        return self.task_source.get("hidden_fields") or hidden_fields()

    def harness_task(self) -> dict:
        """The task as the harness sees it: its reward-only fields left out (the reward gets the full task)."""
        return harness_view(self.task, self.reward_only_fields)

    @property
    def verdict(self) -> str:
        """The report's ok | warning | fail, or '' while there is no report."""
        return self.report.get("verdict", "")
