"""Forms of the harness and reward-script pages: they read the page's inputs (argv and env rows, the code editor)
into the API's shape; the API serializers judge it (one validator), and the pages hand the writes to services."""
from __future__ import annotations

import json
import re
from types import SimpleNamespace
from typing import Any

from django import forms
from django_ace import AceWidget

from api.catalog_serializers import HARNESS_PLACEHOLDERS, HarnessSerializer, RewardScriptSerializer
from catalog import selectors
from catalog.models import Dataset, Executor, Task
from sandbox.executors.base import PLACEHOLDERS, TAIL_BYTES


def placeholders() -> list[dict[str, str]]:
    """The placeholders a harness argv or env value may use, as the page lists them."""
    return [{"name": name, "token": "{" + name + "}", "meaning": PLACEHOLDERS[name]}
            for name in sorted(HARNESS_PLACEHOLDERS)]


class RowsWidget(forms.Widget):
    """Repeated inputs (`argv`, or `env_key` with `env_value`) read as a list; the template draws the rows."""

    def __init__(self, *names: str):
        super().__init__()
        self.names = names

    def value_from_datadict(self, data, files, name):
        columns = [data.getlist(n) for n in self.names]  # a QueryDict: the rows in page order
        if len(columns) == 1:
            return columns[0]
        return [list(row) for row in zip(*columns)]

    def value_omitted_from_data(self, data, files, name):
        return False


class ArgvField(forms.Field):
    widget = RowsWidget("argv")

    def to_python(self, value):
        """The typed arguments in order; empty rows (a spare row left blank) are dropped."""
        return [arg for arg in (value or []) if arg != ""]


class EnvField(forms.Field):
    widget = RowsWidget("env_key", "env_value")

    def to_python(self, value):
        env: dict[str, str] = {}
        for key, item in value or []:
            key = key.strip()
            if not key and not item:
                continue
            if not key:
                raise forms.ValidationError(f"the value {item!r} has no variable name")
            if key in env:
                raise forms.ValidationError(f"{key} is set twice")
            env[key] = item
        return env


class ServiceForm(forms.Form):
    """A form whose cleaned data the API serializer validates again, so the pages and the API share one judge."""

    serializer_class: type
    field_map: dict[str, str] = {}  # serializer field -> form field, where their names differ

    def __init__(self, *args, instance=None, owner=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.instance, self.owner = instance, owner

    def service_fields(self) -> dict[str, Any]:
        """cleaned_data as the serializer (and the service) name the fields."""
        rename = {form: api for api, form in self.field_map.items()}
        return {rename.get(name, name): value for name, value in self.cleaned_data.items()}

    def clean(self):
        cleaned = super().clean()
        if self.errors:
            return cleaned
        # The unique-name check reads `request.user`: name the owner, so staff editing a user's object are
        # checked against that user's names.
        request = SimpleNamespace(user=self.owner)
        serializer = self.serializer_class(self.instance, data=self.service_fields(), context={"request": request})
        if not serializer.is_valid():
            for name, messages in serializer.errors.items():
                field = self.field_map.get(name, name)
                for message in messages:
                    self.add_error(field if field in self.fields else None, str(message))
            return cleaned
        self.validated = dict(serializer.validated_data)
        return cleaned


class HarnessForm(ServiceForm):
    serializer_class = HarnessSerializer
    field_map = {"command": "argv"}

    name = forms.CharField(max_length=200)
    description = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2}))
    argv = ArgvField(label="Command (argv)", required=False,
                     help_text="One argument a row, run without a shell; placeholders are filled per rollout")
    env = EnvField(label="Environment", required=False,
                   help_text="Extra variables for the harness; values may use placeholders too")
    executor = forms.ChoiceField(choices=Executor.choices, initial=Executor.LOCAL)
    image = forms.CharField(max_length=500, required=False, help_text="Container image (kubernetes executor)")
    resources = forms.JSONField(
        required=False, initial=dict,
        widget=forms.Textarea(attrs={"rows": 2, "spellcheck": "false", "placeholder": '{"cpu": "1", "memory": "2Gi"}'}),
        help_text='A JSON object, e.g. {"cpu": "1", "memory": "2Gi"}')
    timeout_s = forms.IntegerField(label="Timeout (s)", initial=600, help_text="Seconds before a rollout is killed")

    def clean_resources(self):
        value = self.cleaned_data.get("resources")
        return {} if value in (None, "") else value

    @classmethod
    def initial_of(cls, harness) -> dict[str, Any]:
        return {"name": harness.name, "description": harness.description, "argv": list(harness.command),
                "env": [[k, v] for k, v in harness.env.items()], "executor": harness.executor,
                "image": harness.image, "resources": harness.resources, "timeout_s": harness.timeout_s}

    def argv_rows(self) -> list[str]:
        """The argv rows to draw: as typed after a refused submit, the harness's own otherwise, one spare blank."""
        rows = self["argv"].value() or []
        return [*rows, ""] if not rows or rows[-1] != "" else rows

    def env_rows(self) -> list[list[str]]:
        value = self["env"].value() or []
        rows = [[k, v] for k, v in value.items()] if isinstance(value, dict) else [list(r) for r in value]
        return [*rows, ["", ""]] if not rows or rows[-1] != ["", ""] else rows


class RewardForm(ServiceForm):
    serializer_class = RewardScriptSerializer

    name = forms.CharField(max_length=200)
    description = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2}))
    source = forms.CharField(
        strip=False, label="Source",
        widget=AceWidget(mode="python", theme="chrome", width="100%", height="380px", useworker=False, toolbar=False,
                         showprintmargin=False, tabsize=4, fontsize="13px"),
        help_text="Define reward(task, outcome) returning a number or {'reward': number, ...more detail}")
    timeout_s = forms.IntegerField(label="Timeout (s)", initial=10, help_text="1 to 300 seconds per scoring")

    def clean_source(self):
        # Browsers post a textarea's line breaks as CRLF (the HTML form encoding): store the source as typed.
        return self.cleaned_data["source"].replace("\r\n", "\n")

    @classmethod
    def initial_of(cls, script) -> dict[str, Any]:
        return {"name": script.name, "description": script.description, "source": script.source,
                "timeout_s": script.timeout_s}


STARTER_SOURCE = '''def reward(task, outcome):
    """task: the full task (reward-only fields too); outcome: what the harness wrote to {output_file}."""
    correct = str(outcome.get("answer")) == str(task.get("answer"))
    return {"reward": float(correct), "correct": correct}
'''

# ---------------------------------------------------------------- the reward test panel

ERROR_LINE = re.compile(r"\(line (\d+)\)\s*$")


def error_line(error: str) -> int | None:
    """The line of the user's source a sandbox error names ("... (line 3)"), if it names one."""
    match = ERROR_LINE.search(error or "")
    return int(match.group(1)) if match else None


def outcome_from_text(text: str) -> dict[str, Any]:
    """The outcome a run passes to reward() when the harness wrote `text` to its output file (none if empty) and
    exited 0. The rule of sandbox.executors.local: a JSON object as is, other JSON as {"output": value}, anything else as
    {"output_raw": text}; then the exit code and stdout are added where the harness did not set them.
    """
    data: dict[str, Any] = {}
    if text.strip():  # an empty box: the harness wrote no output file
        try:
            loaded = json.loads(text)
            data = loaded if isinstance(loaded, dict) else {"output": loaded}
        except ValueError:
            data = {"output_raw": text[:TAIL_BYTES]}
    data.setdefault("exit_code", 0)
    data.setdefault("stdout", "")
    return data


class RewardTestForm(forms.Form):
    """The test panel's request: the source in the editor, a task (one of the user's or pasted) and an outcome."""

    source = forms.CharField(strip=False, error_messages={"required": "the editor is empty"})
    timeout_s = forms.IntegerField(min_value=1, max_value=300, required=False)
    task_source = forms.ChoiceField(choices=[("dataset", "From a dataset"), ("json", "Pasted JSON")],
                                    initial="dataset")
    dataset = forms.IntegerField(required=False)
    task = forms.CharField(required=False, help_text="The task's id, or its index in the dataset")
    task_json = forms.CharField(required=False, strip=False)
    outcome = forms.CharField(required=False, strip=False)

    def __init__(self, user, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.user = user

    def clean(self):
        cleaned = super().clean()
        if cleaned.get("task_source") == "json":
            cleaned["task_data"], cleaned["task_label"] = self._pasted_task(cleaned.get("task_json") or ""), "pasted"
        elif cleaned.get("task_source") == "dataset":
            task = self._dataset_task(cleaned.get("dataset"), (cleaned.get("task") or "").strip())
            if task is not None:
                cleaned["task_data"] = task.data
                cleaned["task_label"] = f"{task.dataset.name} / {task.external_id} (index {task.index}, {task.split})"
        cleaned["outcome_data"] = outcome_from_text(cleaned.get("outcome") or "")
        return cleaned

    def clean_timeout_s(self):
        return self.cleaned_data.get("timeout_s") or RewardForm.base_fields["timeout_s"].initial

    def _pasted_task(self, text: str):
        try:
            task = json.loads(text)
        except ValueError as exc:
            self.add_error("task_json", f"not JSON: {exc}")
            return None
        if not isinstance(task, dict):
            self.add_error("task_json", "a task is a JSON object, as in a dataset")
            return None
        return task

    def _dataset_task(self, dataset_id: int | None, ref: str):
        dataset = (selectors.owned(Dataset.objects.all(), self.user).filter(pk=dataset_id).first()
                   if dataset_id is not None else None)
        if dataset is None:
            self.add_error("dataset", "choose one of your datasets")
            return None
        if not ref:
            self.add_error("task", "give the task's id or its index")
            return None
        tasks = Task.objects.filter(dataset=dataset).select_related("dataset")
        task = tasks.filter(external_id=ref).first() or (tasks.filter(index=int(ref)).first() if ref.isdigit()
                                                        else None)
        if task is None:
            self.add_error("task", f"{dataset.name} has no task with id or index {ref!r}")
        return task
