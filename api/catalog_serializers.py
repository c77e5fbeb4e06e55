"""DRF serializers of the catalog (harnesses, reward scripts, datasets, tasks): input validation lives here,
writes go through services."""
from __future__ import annotations

import ast
import re
import string

from drf_spectacular.utils import extend_schema_field
from kubernetes.utils import parse_quantity
from rest_framework import serializers

from catalog import selectors as catalog_selectors
from catalog.datasets import DEFAULT_HIDDEN_FIELDS, SEED_MAX, SEED_MIN, field_names
from catalog.models import Dataset, Executor, Harness, RewardScript, Task
from sandbox import isolation
from sandbox.executors.base import PLACEHOLDERS

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
        return catalog_selectors.owned(super().get_queryset(), self.context["request"].user)


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
    seed = serializers.IntegerField(required=False, default=0, min_value=SEED_MIN, max_value=SEED_MAX)
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
