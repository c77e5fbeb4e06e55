"""DRF serializers: one per shape; input validation lives here, writes go through services."""
from __future__ import annotations

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from api.catalog_serializers import OwnedPrimaryKeyRelatedField
from catalog.models import Dataset, Harness, RewardScript
from runs import pools
from runs.models import CheckEngine, HarnessCheck, Metric, ModelCall, Rollout, Run, RunEvent, Sample


class PoolWaitSerializer(serializers.Serializer):
    pool = serializers.CharField()
    ahead = serializers.IntegerField(help_text="Queued runs of the pool created before this one")
    message = serializers.CharField(help_text="'waiting for pool X (n ahead)'")


class RunSerializer(serializers.ModelSerializer):
    waiting = serializers.SerializerMethodField(help_text="While queued: the pool it waits for; null otherwise")
    open_alarms = serializers.SerializerMethodField(help_text="Health alarms not acknowledged (/runs/<id>/alarms/)")

    class Meta:
        model = Run
        fields = ["id", "name", "model", "model_info", "config", "harness", "dataset", "reward_script", "harness_snapshot",
                  "dataset_snapshot", "reward_snapshot", "cloned_from", "status", "step", "policy_version", "error",
                  "checkpoint_path", "celery_task_id", "heartbeat_at", "worker_starts", "isolation", "host", "pool", "waiting",
                  "open_alarms", "created_at", "started_at", "finished_at"]
        read_only_fields = fields

    @extend_schema_field(PoolWaitSerializer(allow_null=True))
    def get_waiting(self, run):
        return pools.waiting(run)

    def get_open_alarms(self, run) -> int:
        annotated = getattr(run, "open_alarms_n", None)  # RunViewSet's lists annotate it: no query a row
        return annotated if annotated is not None else run.alarms.filter(acknowledged_at__isnull=True).count()


class PoolField(serializers.CharField):
    """A pool name that LIGHTNING_POOLS knows (a typo is a field error listing the pools)."""

    def __init__(self, **kwargs):
        kwargs.setdefault("max_length", 100)
        kwargs.setdefault("help_text", "The worker pool that runs it (LIGHTNING_POOLS; 'default' unless set)")
        super().__init__(**kwargs)

    def to_internal_value(self, data):
        value = super().to_internal_value(data)
        try:
            return pools.check_pool(value)
        except ValueError as exc:
            raise serializers.ValidationError(str(exc)) from None


class RunCreateSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=200)
    model = serializers.CharField(max_length=500)
    config = serializers.JSONField(required=False, default=dict, help_text="TrainerConfig fields; defaults fill the rest")
    harness = OwnedPrimaryKeyRelatedField(queryset=Harness.objects.all())
    dataset = OwnedPrimaryKeyRelatedField(queryset=Dataset.objects.all())
    reward_script = OwnedPrimaryKeyRelatedField(queryset=RewardScript.objects.all())
    pool = PoolField(required=False, default=pools.DEFAULT_POOL)

    def validate_config(self, value):
        if not isinstance(value, dict):
            raise serializers.ValidationError("must be an object of TrainerConfig fields")
        return value


class RunCloneSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=200, required=False)
    pool = PoolField(required=False, help_text="Another pool for the clone (default: the run's own)")


class RunContinueSerializer(serializers.Serializer):
    steps = serializers.IntegerField(min_value=1, max_value=100_000, help_text="Training steps to add")


class MetricSerializer(serializers.ModelSerializer):
    class Meta:
        model = Metric
        fields = ["step", "name", "value", "created_at"]


class SignalStepSerializer(serializers.Serializer):
    step = serializers.IntegerField()
    groups_sampled = serializers.IntegerField(allow_null=True, help_text="Groups the step sampled (trained + dropped)")
    groups_with_signal = serializers.IntegerField(allow_null=True,
                                                  help_text="Sampled groups whose counted rewards differ")
    groups_trained = serializers.IntegerField(allow_null=True)
    groups_trained_with_signal = serializers.IntegerField(allow_null=True)
    groups_dropped_no_signal = serializers.IntegerField(allow_null=True,
                                                        help_text="Dropped by dynamic sampling: recorded, not trained")
    extra_rollouts = serializers.IntegerField(allow_null=True, help_text="Rollouts of the dropped groups")
    signal_share = serializers.FloatField(allow_null=True, help_text="Share of the trained groups with signal")
    sampled_signal_share = serializers.FloatField(allow_null=True,
                                                  help_text="Share of all sampled groups with signal")


class SignalNoticeSerializer(serializers.Serializer):
    share = serializers.FloatField()
    steps = serializers.ListField(child=serializers.IntegerField(), help_text="First and last step of the window")
    text = serializers.CharField()


class SignalSerializer(serializers.Serializer):
    dynamic_sampling = serializers.BooleanField()
    low_share = serializers.FloatField(help_text="The notice shows below this mean sampled share")
    window = serializers.IntegerField(help_text="Steps the notice averages over")
    steps = SignalStepSerializer(many=True)
    notice = SignalNoticeSerializer(allow_null=True)


class ValidationCellSerializer(serializers.Serializer):
    attempts = serializers.IntegerField(help_text="Sampled attempts that count (finished, not infrastructure failures)")
    passed = serializers.IntegerField()
    pass_fraction = serializers.FloatField(allow_null=True)
    greedy = serializers.BooleanField(allow_null=True, help_text="Whether the greedy attempt passed; null without one")
    infra_failures = serializers.IntegerField()
    unscored = serializers.IntegerField(help_text="Attempts pending, running, cancelled or lost")


class ValidationRowSerializer(serializers.Serializer):
    task = serializers.IntegerField()
    external_id = serializers.CharField()
    index = serializers.IntegerField()
    cells = serializers.ListField(child=ValidationCellSerializer(allow_null=True),
                                  help_text="One per entry of `steps`; null where the task was not evaluated")


class ValidationGridSerializer(serializers.Serializer):
    """Output only: what selectors.validation_grid returns (for the schema)."""

    pass_threshold = serializers.FloatField()
    steps = serializers.ListField(child=serializers.IntegerField())
    tasks = ValidationRowSerializer(many=True)


class RunEventSerializer(serializers.ModelSerializer):
    class Meta:
        model = RunEvent
        fields = ["seq", "kind", "payload", "created_at"]


class ModelCallSerializer(serializers.ModelSerializer):
    class Meta:
        model = ModelCall
        fields = ["id", "seq", "api", "stream", "request", "response", "prompt_ids", "completion_ids", "logprobs",
                  "finish_reason", "status_code", "latency_ms", "policy_version", "drift", "sampling_overrides",
                  "constraint", "choice", "error", "replica", "retried", "created_at"]


class SampleSerializer(serializers.ModelSerializer):
    class Meta:
        model = Sample
        fields = ["id", "index", "token_ids", "loss_mask", "logprobs", "advantage", "call_seqs", "build",
                  "policy_version", "created_at"]


class RolloutSerializer(serializers.ModelSerializer):
    task_external_id = serializers.CharField(source="task.external_id", default=None, read_only=True)
    fate = serializers.CharField(read_only=True, help_text="What its training step did with it, in words: 'sampled "
                                                           "for step 3: trained' or '...: dropped (why)'; '' before")

    class Meta:
        model = Rollout
        fields = ["id", "run", "task", "task_external_id", "split", "step", "group", "attempt", "greedy",
                  "policy_version", "status", "failure_kind", "reward", "reward_detail", "exit_code", "error",
                  "call_count", "batch_step", "trained_step", "drop_reason", "fate", "created_at", "started_at",
                  "finished_at"]
        read_only_fields = fields


class RolloutDetailSerializer(RolloutSerializer):
    calls = ModelCallSerializer(many=True, read_only=True)
    samples = SampleSerializer(many=True, read_only=True)
    task_data = serializers.JSONField(source="task.data", default=None, read_only=True)

    class Meta(RolloutSerializer.Meta):
        fields = RolloutSerializer.Meta.fields + ["task_data", "stdout_tail", "stderr_tail", "calls", "samples"]


class HarnessCheckSerializer(serializers.ModelSerializer):
    verdict = serializers.CharField(read_only=True, help_text="ok | warning | fail once the report is in; '' before")

    class Meta:
        model = HarnessCheck
        fields = ["id", "harness", "harness_version", "task", "task_source", "reward_script", "engine", "model",
                  "status", "verdict", "report", "error", "created_at", "started_at", "finished_at"]
        read_only_fields = fields


class HarnessCheckCreateSerializer(serializers.Serializer):
    """The task is typed (`task`) or one of the user's datasets' (`dataset` with `task_id`, its id in the dataset)."""

    task = serializers.JSONField(required=False, help_text="A task object, as in a dataset")
    dataset = OwnedPrimaryKeyRelatedField(queryset=Dataset.objects.all(), required=False)
    task_id = serializers.CharField(required=False, max_length=200, help_text="The task's id in `dataset`")
    reward_script = OwnedPrimaryKeyRelatedField(queryset=RewardScript.objects.all(), required=False, allow_null=True)
    model = serializers.CharField(max_length=500, help_text="A registry model with tokenizer files")
    engine = serializers.ChoiceField(choices=CheckEngine.choices, default=CheckEngine.SCRIPTED)

    def validate(self, attrs):
        typed, dataset, task_id = attrs.pop("task", None), attrs.pop("dataset", None), attrs.pop("task_id", None)
        if (typed is None) == (dataset is None):
            raise serializers.ValidationError({"task": "give either a task object or a dataset with a task_id"})
        if typed is not None:
            if not isinstance(typed, dict):
                raise serializers.ValidationError({"task": "a task is a JSON object, as in a dataset"})
            return {**attrs, "task": typed}
        if not task_id:
            raise serializers.ValidationError({"task_id": f"which task of dataset {dataset.name!r}? give its id"})
        task = dataset.tasks.select_related("dataset").filter(external_id=task_id).first()
        if task is None:
            raise serializers.ValidationError({"task_id": f"dataset {dataset.name!r} has no task {task_id!r}"})
        return {**attrs, "task": task}


class WorkerTaskSerializer(serializers.Serializer):
    task = serializers.CharField(help_text="The Celery task's name, e.g. runs.tasks.execute_run")
    id = serializers.CharField(help_text="The Celery task id")
    run = serializers.IntegerField(allow_null=True, help_text="The run it executes (execute_run); null otherwise")
    run_name = serializers.CharField(allow_null=True, help_text="Null for a run of another user (or none)")
    run_status = serializers.CharField(allow_null=True)
    device_set = serializers.IntegerField(allow_null=True, help_text="Index of the worker's device set it holds")
    devices = serializers.CharField(allow_null=True, help_text="Its CUDA_VISIBLE_DEVICES ('' for every device)")


class WorkerSerializer(serializers.Serializer):
    name = serializers.CharField(help_text="The Celery node name, e.g. pool-gpu-a100@host")
    queues = serializers.ListField(child=serializers.CharField(), help_text="The queues it consumes")
    pools = serializers.ListField(child=serializers.CharField(), help_text="The run pools of those queues")
    heartbeat_age_s = serializers.FloatField(allow_null=True, help_text="Seconds since its last heartbeat event")
    pid = serializers.IntegerField(allow_null=True)
    uptime_s = serializers.IntegerField(allow_null=True)
    concurrency = serializers.IntegerField(allow_null=True, help_text="Tasks it runs at once (its device sets)")
    processed = serializers.IntegerField(help_text="Tasks it has taken since it started")
    active = WorkerTaskSerializer(many=True)
    host = serializers.CharField(help_text="Its CPU and the dtypes `auto` picks there (trainer.host), e.g. 'CPU: AVX2, "
                                           "no native bf16 (...) -> engine float32, trainer float32'; '' unknown")


class WorkersSerializer(serializers.Serializer):
    """Output only: what runs.worker_status.inspect_workers returns (for the schema)."""

    checked_at = serializers.DateTimeField()
    timeout_s = serializers.FloatField(help_text="How long the workers had to answer")
    answered = serializers.BooleanField(help_text="False when no worker answered within timeout_s")
    workers = WorkerSerializer(many=True)
