"""Dashboard forms; they validate shapes and hand the writes to services."""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
from pathlib import Path
from typing import Any

from django import forms

from catalog import registry, selectors
from catalog.models import Dataset, Harness, RewardScript
from catalog.registry import UnknownModel
from runs import pools
from runs.models import Run
from runs.presets import Preset
from trainer import config as trainer_config
from trainer.config import ConfigError, TrainerConfig

BASIC_FIELDS = ("steps", "tasks_per_step", "group_size", "learning_rate", "temperature", "mode")
CONFIG_CHOICES = {"mode": trainer_config.MODES, "advantage": trainer_config.ADVANTAGE_ESTIMATORS,
                  "loss_agg": trainer_config.LOSS_AGGREGATIONS, "dtype": trainer_config.DTYPES,
                  "engine_dtype": trainer_config.ENGINE_DTYPES}
RUN_FIELDS = ("name", "model", "harness", "dataset", "reward_script", "pool")


@functools.cache
def config_field_docs() -> dict[str, str]:
    """Each TrainerConfig field's attribute docstring (the string literal under it), whitespace folded to one line.

    Read from TrainerConfig's source once (cached), so the form's help can never drift from the dataclass.
    """
    cls = ast.parse(inspect.getsource(TrainerConfig)).body[0]
    docs = {}
    for node, after in zip(cls.body, cls.body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def config_defaults() -> dict[str, Any]:
    return TrainerConfig().to_dict()


def config_group(name: str) -> str:
    if name in BASIC_FIELDS:
        return "basic"
    return "evaluation" if name.startswith("eval_") else "advanced"


def _config_form_field(f: dataclasses.Field, default: Any, help_text: str) -> forms.Field:
    """A typed form field for one TrainerConfig field; bounds and combinations are TrainerConfig's to check."""
    label = f.name.replace("_", " ").capitalize()
    common = {"label": label, "help_text": help_text, "initial": default}
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    if f.name in CONFIG_CHOICES:
        return forms.ChoiceField(choices=[(v, v) for v in CONFIG_CHOICES[f.name]], **common)
    if kind == "bool":
        return forms.BooleanField(required=False, **common)
    if kind == "int":
        return forms.IntegerField(**common)
    if kind == "float":
        return forms.FloatField(widget=forms.NumberInput(attrs={"step": "any"}), **common)
    if kind == "dict":
        return forms.JSONField(required=False, widget=forms.Textarea(attrs={"rows": 3, "spellcheck": "false"}),
                               **common)
    return forms.CharField(**common)


CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(TrainerConfig))
assert not set(CONFIG_FIELDS) & set(RUN_FIELDS), "a TrainerConfig field shadows a run field of RunForm"

# Plain names (not a prefix): the form posts the same keys the API's `config` object takes.
_FIELD_PATTERN = re.compile(r"\b(" + "|".join(sorted(CONFIG_FIELDS, key=len, reverse=True)) + r")\b")


def config_error_field(message: str) -> str | None:
    """The TrainerConfig field a ConfigError message is about: the first one its fix names (the clause after the
    last ';', e.g. "...; set groups_in_flight=0 or mode='async'"), else the first one it names at all."""
    for text in (message.rpartition(";")[2], message):
        match = _FIELD_PATTERN.search(text)
        if match:
            return match.group(1)
    return None


class RunForm(forms.Form):
    name = forms.CharField(max_length=200)
    model = forms.ChoiceField(help_text="Models in the registry (data/models)")
    harness = forms.ModelChoiceField(queryset=Harness.objects.none())
    dataset = forms.ModelChoiceField(queryset=Dataset.objects.none())
    reward_script = forms.ModelChoiceField(queryset=RewardScript.objects.none())
    pool = forms.ChoiceField(required=False, initial=pools.DEFAULT_POOL, help_text=(
        "The worker pool that runs it: its workers are started with ./lw worker --pool NAME (LIGHTNING_POOLS)"))

    groups = (("run", "Run"), ("basic", "Basic"), ("evaluation", "Evaluation"), ("advanced", "Advanced"))

    def __init__(self, user, *args, clone: Run | None = None, preset: Preset | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        docs, defaults = config_field_docs(), config_defaults()
        for f in dataclasses.fields(TrainerConfig):
            self.fields[f.name] = _config_form_field(f, defaults[f.name], docs.get(f.name, ""))
        models = [(m.name, f"{m.name} ({m.origin}, {m.size_bytes / 1e6:.0f} MB)") for m in registry.registered_models()]
        # The user's own runs' latest checkpoints: the only model folders outside the registry a run may name.
        checkpoints = Run.objects.filter(owner=user).exclude(checkpoint_path="")
        models += [(path, f"checkpoint of run #{pk} {name} ({Path(path).name})")
                   for pk, name, path in checkpoints.values_list("pk", "name", "checkpoint_path")]
        if clone is not None and clone.model not in dict(models):
            models.append((clone.model, clone.model))  # a folder path or engine URL; create_run resolves it again
        self.fields["model"].choices = models
        self.fields["harness"].queryset = selectors.owned(Harness.objects.all(), user)
        self.fields["dataset"].queryset = selectors.owned(Dataset.objects.all(), user)
        self.fields["reward_script"].queryset = selectors.owned(RewardScript.objects.all(), user)
        self.fields["pool"].choices = [(name, name) for name in pools.known_pools()]
        if clone is not None:
            self.initial.update(self.initial_from_run(clone))
        elif preset is not None:
            self.initial.update(self.initial_from_preset(user, preset))

    @staticmethod
    def initial_from_run(run: Run) -> dict[str, Any]:
        """The form filled from an existing run: its objects, model and config (fields it lacks keep defaults)."""
        config = {name: value for name, value in (run.config or {}).items() if name in CONFIG_FIELDS}
        return {"name": f"{run.name} (clone)", "model": run.model, "harness": run.harness_id,
                "dataset": run.dataset_id, "reward_script": run.reward_script_id, "pool": run.pool, **config}

    @staticmethod
    def initial_from_preset(user, preset: Preset) -> dict[str, Any]:
        """The form filled from a preset: its model and config (tagged with the preset's slug in extra.preset) and
        the user's harness, dataset and reward script of the names it gives, where the user has them."""
        def named(model, name):
            return selectors.owned(model.objects.all(), user).filter(name=name).values_list("pk", flat=True).first()

        config = {name: value for name, value in preset.tagged_config.items() if name in CONFIG_FIELDS}
        return {"name": preset.slug, "model": preset.model, "harness": named(Harness, preset.harness),
                "dataset": named(Dataset, preset.dataset), "reward_script": named(RewardScript, preset.reward_script),
                **config}

    def field_groups(self) -> list[dict[str, Any]]:
        """Bound fields by fieldset for the template; a group holding an error is marked so it renders open."""
        members = {key: [] for key, _ in self.groups}
        for name in self.fields:
            members["run" if name in RUN_FIELDS else config_group(name)].append(self[name])
        return [{"key": key, "title": title, "fields": members[key], "has_errors": any(f.errors for f in members[key])}
                for key, title in self.groups]

    def clean_pool(self):
        return self.cleaned_data.get("pool") or pools.DEFAULT_POOL

    def clean_extra(self):
        return _json_object(self.cleaned_data.get("extra"), '{"note": "baseline"}')

    def clean_health(self):
        return _json_object(self.cleaned_data.get("health"), '{"no_signal_share": 0.9}')

    def run_arguments(self) -> dict[str, Any]:
        """cleaned_data as services.create_run takes it: the run's fields plus a `config` dict."""
        data = self.cleaned_data
        return {**{name: data[name] for name in RUN_FIELDS}, "config": {name: data[name] for name in CONFIG_FIELDS}}

    def add_service_error(self, exc: Exception) -> None:
        """Show a refusal of services.create_run beside the field it names (above the form otherwise)."""
        cause = exc.__cause__
        if isinstance(cause, ConfigError):
            self.add_error(config_error_field(str(cause)), str(cause))
        elif isinstance(cause, UnknownModel):
            self.add_error("model", str(cause))
        else:
            self.add_error(None, str(exc))


def _json_object(value, example: str) -> dict:
    if value in (None, ""):
        return {}
    if not isinstance(value, dict):
        raise forms.ValidationError(f"must be a JSON object, e.g. {example}")
    return value
