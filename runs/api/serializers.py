"""DRF serializers: one per shape; input validation lives here, writes go through services."""
from __future__ import annotations

import ast
import re
import string

from drf_spectacular.utils import extend_schema_field
from kubernetes.utils import parse_quantity
from rest_framework import serializers

from runs import isolation, pools, selectors
from runs.datasets import DEFAULT_HIDDEN_FIELDS, field_names
from runs.executor import PLACEHOLDERS
from runs.models import (CheckEngine, Dataset, Executor, Harness, HarnessCheck, Metric, ModelCall, RewardScript,
                         Rollout, Run, RunEvent, Sample, Task)

HARNESS_PLACEHOLDERS = frozenset(PLACEHOLDERS)
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_IMAGE_PART = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_IMAGE_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_IMAGE_HOST = (rf"(?:(?:localhost|{_IMAGE_LABEL}(?:\.{_IMAGE_LABEL})+|\[[0-9A-Fa-f:]+\])(?::[0-9]+)?"
               rf"|{_IMAGE_LABEL}:[0-9]+)")  # a registry has a dot or a port, or is localhost
IMAGE_REF = re.compile(rf"^(?:{_IMAGE_HOST}/)?{_IMAGE_PART}(?:/{_IMAGE_PART})*(?::[A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}})?"
                       r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9A-Fa-f]{32,})?$")
"""A container image reference as the distribution spec (docker/distribution `reference`) writes it."""
RESOURCE_KEYS = ("cpu", "memory", "gpu", "read_only")
CPU = re.compile(r"^[0-9]+(?:\.[0-9]+)?m?$")
MEMORY = re.compile(r"^[0-9]+(?:\.[0-9]+)?(?:[KMGTPE]i|[kMGTPE])?$")


class OwnedPrimaryKeyRelatedField(serializers.PrimaryKeyRelatedField):
    """A reference to one of the requesting user's own objects (staff may name any)."""

    def get_queryset(self):
        return selectors.owned(super().get_queryset(), self.context["request"].user)


def _check_placeholders(what: str, text: str) -> None:
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(text) if name is not None}
    except ValueError as exc:
        raise serializers.ValidationError(f"{what}: {exc}; write literal braces as {{{{ }}}}")
    unknown = names - HARNESS_PLACEHOLDERS
    if unknown:
        raise serializers.ValidationError(
            f"unknown placeholder(s) {sorted(unknown)}; available: {sorted(HARNESS_PLACEHOLDERS)}")


def _check_quantity(resources: dict, key: str, pattern: re.Pattern, what: str) -> None:
    """A Kubernetes quantity (kubernetes.utils.parse_quantity reads it) above zero, in the units `pattern` allows."""
    if key not in resources:
        return
    value = resources[key]
    text = str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    try:
        ok = isinstance(text, str) and bool(pattern.match(text)) and parse_quantity(text) > 0
    except ValueError:
        ok = False
    if not ok:
        raise serializers.ValidationError(f"{key} must be {what}, got {value!r}")


class UniqueNameMixin:
    """Names are unique per owner: say so as a field error rather than failing on the constraint."""

    def validate_name(self, value):
        model = self.Meta.model
        owner = self.instance.owner if self.instance is not None else self.context["request"].user  # staff edits
        mine = model.objects.filter(owner=owner, name=value)
        if self.instance is not None:
            mine = mine.exclude(pk=self.instance.pk)
        if mine.exists():
            raise serializers.ValidationError(f"you already have a {model._meta.verbose_name} named {value!r}")
        return value


class ModelInfoSerializer(serializers.Serializer):
    name = serializers.CharField()
    path = serializers.CharField()
    size_bytes = serializers.IntegerField()
    origin = serializers.CharField(help_text="tiny | smollm2-gguf | checkpoint | unknown ...")
    params = serializers.IntegerField(allow_null=True)
    created = serializers.CharField(allow_null=True)


class HarnessSerializer(UniqueNameMixin, serializers.ModelSerializer):
    class Meta:
        model = Harness
        fields = ["id", "name", "description", "command", "env", "executor", "image", "resources", "timeout_s",
                  "version", "created_at", "updated_at"]
        read_only_fields = ["version", "created_at", "updated_at"]

    def validate_command(self, value):
        if not isinstance(value, list) or not value or not all(isinstance(a, str) and a for a in value):
            raise serializers.ValidationError("must be a non-empty list of non-empty strings (an argv list)")
        for arg in value:
            _check_placeholders(f"argument {arg!r}", arg)
        return value

    def validate_env(self, value):
        if not isinstance(value, dict):
            raise serializers.ValidationError("must be an object of NAME: value strings")
        for key, item in value.items():
            if not ENV_NAME.match(key):
                raise serializers.ValidationError(f"{key!r} is not a valid environment variable name")
            if not isinstance(item, str):
                raise serializers.ValidationError(f"value of {key} must be a string, got {type(item).__name__}")
            _check_placeholders(f"value of {key}", item)  # the executor fills env values as it fills argv
        return value

    def validate_image(self, value):
        if value and (len(value) > 255 or not IMAGE_REF.match(value)):
            raise serializers.ValidationError(f"{value!r} is not a container image reference such as "
                                              "ghcr.io/me/agent:1 or python:3.12-slim (lowercase name, optional tag "
                                              "and @sha256 digest)")
        return value

    def validate_resources(self, value):
        if not isinstance(value, dict):
            raise serializers.ValidationError("must be an object such as {\"cpu\": \"1\", \"memory\": \"2Gi\"}")
        unknown = sorted(set(value) - set(RESOURCE_KEYS))
        if unknown:
            raise serializers.ValidationError(f"unknown key(s) {unknown}; allowed: {', '.join(RESOURCE_KEYS)}")
        _check_quantity(value, "cpu", CPU, 'a CPU quantity such as "500m" or "2"')
        _check_quantity(value, "memory", MEMORY, 'a memory quantity such as "512Mi" or "2Gi"')
        gpu = value.get("gpu", 0)
        if isinstance(gpu, bool) or not (isinstance(gpu, int) or (isinstance(gpu, str) and gpu.isdigit())):
            raise serializers.ValidationError("gpu must be a whole number of GPUs, such as 1")
        read_only = value.get("read_only", [])
        if not (isinstance(read_only, list) and all(isinstance(p, str) and p.startswith("/") for p in read_only)):
            raise serializers.ValidationError("read_only must be a list of absolute paths the harness is shown "
                                              "read-only in its sandbox")
        for path in read_only:
            try:
                isolation.check_visible(isolation.real_path(path), "read-only path")
            except isolation.IsolationError as exc:
                raise serializers.ValidationError(str(exc)) from exc
        return value

    def validate_timeout_s(self, value):
        if not 1 <= value <= 7 * 24 * 3600:
            raise serializers.ValidationError("must be between 1 second and 7 days")
        return value

    def validate(self, attrs):
        executor = attrs.get("executor", getattr(self.instance, "executor", Executor.LOCAL))
        image = attrs.get("image", getattr(self.instance, "image", ""))
        if executor == Executor.KUBERNETES and not image:
            raise serializers.ValidationError({"image": "a kubernetes harness needs a container image"})
        return attrs


class RewardScriptSerializer(UniqueNameMixin, serializers.ModelSerializer):
    class Meta:
        model = RewardScript
        fields = ["id", "name", "description", "source", "timeout_s", "version", "created_at", "updated_at"]
        read_only_fields = ["version", "created_at", "updated_at"]
        extra_kwargs = {"source": {"trim_whitespace": False}}

    def validate_source(self, value):
        try:
            tree = ast.parse(value, filename="<reward>")
        except SyntaxError as exc:
            raise serializers.ValidationError(f"SyntaxError: {exc.msg} (line {exc.lineno})")
        if not any(isinstance(node, ast.FunctionDef) and node.name == "reward" for node in tree.body):
            raise serializers.ValidationError("the script must define a top-level function reward(task, outcome)")
        return value

    def validate_timeout_s(self, value):
        if not 1 <= value <= 300:
            raise serializers.ValidationError("must be between 1 and 300 seconds")
        return value


class RewardTestSerializer(serializers.Serializer):
    task = serializers.JSONField(help_text="The task object as stored in a dataset")
    outcome = serializers.JSONField(help_text="What the harness produced, as the reward function receives it")


class RewardTestResultSerializer(serializers.Serializer):
    ok = serializers.BooleanField()
    reward = serializers.FloatField(allow_null=True)
    detail = serializers.DictField()
    error = serializers.CharField(allow_blank=True)
    kind = serializers.CharField(allow_blank=True, help_text="exception|syntax|timeout|memory|output|crashed")
    output = serializers.CharField(allow_blank=True, help_text="Tail of what the script printed")
    duration_ms = serializers.FloatField()


@extend_schema_field({"oneOf": [{"type": "array", "items": {"type": "string"}}, {"type": "string"}]})
class FieldNamesField(serializers.Field):
    """Task field names: a JSON list, or in a form a JSON list, a comma-separated string or the key repeated."""

    def get_value(self, dictionary):
        if hasattr(dictionary, "getlist") and self.field_name in dictionary:
            values = dictionary.getlist(self.field_name)
            return values if len(values) > 1 else values[0]
        return super().get_value(dictionary)

    def to_internal_value(self, data):
        try:
            return field_names(data)
        except ValueError as exc:
            raise serializers.ValidationError(str(exc)) from None

    def to_representation(self, value):
        return list(value)


class DatasetSerializer(UniqueNameMixin, serializers.ModelSerializer):
    hidden_fields = serializers.ListField(child=serializers.CharField(), read_only=True,
                                          help_text="The dataset's own reward-only fields, set at upload")
    reward_only_fields = serializers.ListField(
        child=serializers.CharField(), read_only=True,
        help_text=f"Every field no harness sees: the defaults {list(DEFAULT_HIDDEN_FIELDS)} and hidden_fields")

    class Meta:
        model = Dataset
        fields = ["id", "name", "description", "version", "source_filename", "content_sha256", "split_field",
                  "val_ratio", "seed", "train_count", "val_count", "hidden_fields", "reward_only_fields",
                  "created_at", "updated_at"]
        read_only_fields = [f for f in fields if f not in ("name", "description")]


class DatasetUploadSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=200)
    description = serializers.CharField(required=False, allow_blank=True, default="")
    file = serializers.FileField(
        allow_empty_file=True,
        help_text="JSONL (one task object per line) or a JSON array of task objects. A rollouts export "
                  "(docs/export-schema.md) becomes a dataset of recorded trajectories.")
    split_field = serializers.CharField(required=False, allow_blank=True, default="",
                                        help_text="Field holding 'train' or 'val' on every task")
    val_ratio = serializers.FloatField(required=False, default=0.1, min_value=0.0, max_value=1.0,
                                       help_text="Share of tasks without a split that go to val (seeded)")
    seed = serializers.IntegerField(required=False, default=0)
    required_fields = serializers.CharField(required=False, allow_blank=True, default="",
                                            help_text="Comma-separated fields every task must have")
    hidden_fields = FieldNamesField(
        required=False, default=list,
        help_text=f"Reward-only fields no harness sees, beyond the defaults {list(DEFAULT_HIDDEN_FIELDS)} (which "
                  "always stay hidden): a JSON list or a comma-separated string. The reward gets the full task.")

    def validate_name(self, value):
        user = self.context["request"].user
        if Dataset.objects.filter(owner=user, name=value).exists():
            raise serializers.ValidationError(f"you already have a dataset named {value!r}")
        return value

    def validate_required_fields(self, value):
        return tuple(name.strip() for name in value.split(",") if name.strip())


class TaskSerializer(serializers.ModelSerializer):
    class Meta:
        model = Task
        fields = ["id", "dataset", "index", "external_id", "split", "data"]


class PoolWaitSerializer(serializers.Serializer):
    pool = serializers.CharField()
    ahead = serializers.IntegerField(help_text="Queued runs of the pool created before this one")
    message = serializers.CharField(help_text="'waiting for pool X (n ahead)'")


class RunSerializer(serializers.ModelSerializer):
    waiting = serializers.SerializerMethodField(help_text="While queued: the pool it waits for; null otherwise")

    class Meta:
        model = Run
        fields = ["id", "name", "model", "model_info", "config", "harness", "dataset", "reward_script", "harness_snapshot",
                  "dataset_snapshot", "reward_snapshot", "cloned_from", "status", "step", "policy_version", "error",
                  "checkpoint_path", "celery_task_id", "heartbeat_at", "worker_starts", "isolation", "host", "pool", "waiting",
                  "created_at", "started_at", "finished_at"]
        read_only_fields = fields

    @extend_schema_field(PoolWaitSerializer(allow_null=True))
    def get_waiting(self, run):
        return pools.waiting(run)


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

    class Meta:
        model = Rollout
        fields = ["id", "run", "task", "task_external_id", "split", "step", "group", "attempt", "greedy",
                  "policy_version", "status", "failure_kind", "reward", "reward_detail", "exit_code", "error",
                  "call_count", "created_at", "started_at", "finished_at"]
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
