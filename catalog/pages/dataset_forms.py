"""The dataset upload form: shapes and limits only; parsing, splitting and saving are services.create_dataset's."""
from __future__ import annotations

from django import forms
from django.conf import settings
from django.template.defaultfilters import filesizeformat

from catalog.datasets import DEFAULT_HIDDEN_FIELDS, SEED_MAX, SEED_MIN, field_names
from catalog.models import Dataset

SPLIT_BY_RATIO = "ratio"
SPLIT_BY_FIELD = "field"


class DatasetUploadForm(forms.Form):
    file = forms.FileField(
        allow_empty_file=True,
        help_text="JSONL (one task object per line) or a JSON array of task objects. An optional \"id\" field "
                  "names each task; without it the task's position is its id. A run's rollouts export "
                  "(docs/export-schema.md) becomes a dataset of recorded trajectories.")
    name = forms.CharField(max_length=200)
    description = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2}))
    split_by = forms.ChoiceField(
        choices=[(SPLIT_BY_RATIO, "A share of the tasks goes to val (seeded draw)"),
                 (SPLIT_BY_FIELD, "A field of every task says train or val")],
        initial=SPLIT_BY_RATIO, widget=forms.RadioSelect)
    val_ratio = forms.FloatField(
        min_value=0.0, max_value=1.0, initial=0.1, required=False,
        widget=forms.NumberInput(attrs={"step": "any"}),
        help_text="Share of the tasks that go to val; a task with its own \"split\" field keeps it.")
    seed = forms.IntegerField(initial=0, required=False, min_value=SEED_MIN, max_value=SEED_MAX,
                              help_text="Seed of the draw: the same file and seed give the same split.")
    split_field = forms.CharField(
        max_length=100, required=False,
        help_text="Name of the field holding \"train\" or \"val\"; every task must have it.")
    hidden_fields = forms.CharField(
        required=False, max_length=2000,
        help_text=f"Reward-only fields, comma-separated: the reward sees them, no harness does. "
                  f"{', '.join(DEFAULT_HIDDEN_FIELDS)} are always hidden.")
    required_fields = forms.CharField(required=False, max_length=2000,
                                      help_text="Fields every task must have, comma-separated (optional).")

    def __init__(self, user, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.user = user

    def clean_file(self):
        file = self.cleaned_data["file"]
        limit = settings.LIGHTNING_DATASET_MAX_BYTES
        if file.size > limit:  # refused before reading it into memory; the service checks the bytes again
            raise forms.ValidationError(
                f"the file is {filesizeformat(file.size)} ({file.size} bytes), over the limit of "
                f"{filesizeformat(limit)} ({limit} bytes; LIGHTNING_DATASET_MAX_BYTES)")
        return file

    def clean_name(self):
        name = self.cleaned_data["name"].strip()
        if not name:
            raise forms.ValidationError("give the dataset a name")
        if Dataset.objects.filter(owner=self.user, name=name).exists():
            raise forms.ValidationError(f"you already have a dataset named {name!r}; choose another name")
        return name

    def clean_hidden_fields(self):
        return self._names("hidden_fields")

    def clean_required_fields(self):
        return self._names("required_fields")

    def _names(self, key: str) -> list[str]:
        try:
            return field_names(self.cleaned_data[key])
        except ValueError as exc:
            raise forms.ValidationError(str(exc)) from None

    def clean(self):
        data = super().clean()
        if data.get("split_by") == SPLIT_BY_FIELD:
            if not (data.get("split_field") or "").strip():
                self.add_error("split_field", "name the field that holds train or val")
        elif data.get("val_ratio") is None and "val_ratio" not in self.errors:
            self.add_error("val_ratio", "give a share between 0 and 1, e.g. 0.1")
        return data

    def dataset_arguments(self) -> dict:
        """Keyword arguments of services.create_dataset (the file read here, once)."""
        data = self.cleaned_data
        by_field = data["split_by"] == SPLIT_BY_FIELD
        file = data["file"]
        return {"name": data["name"], "description": data["description"], "content": file.read(),
                "filename": file.name or "", "split_field": data["split_field"].strip() if by_field else "",
                "val_ratio": 0.0 if by_field else data["val_ratio"], "seed": data["seed"] or 0,
                "hidden_fields": data["hidden_fields"], "required_fields": tuple(data["required_fields"])}
