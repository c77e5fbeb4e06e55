"""Dashboard forms; they validate shapes and hand the writes to services."""
from __future__ import annotations

import json

from django import forms

from runs import registry, selectors
from runs.models import Dataset, Harness, RewardScript
from trainer.config import TrainerConfig


class RunForm(forms.Form):
    name = forms.CharField(max_length=200)
    model = forms.ChoiceField(help_text="Models in the registry (data/models)")
    harness = forms.ModelChoiceField(queryset=Harness.objects.none())
    dataset = forms.ModelChoiceField(queryset=Dataset.objects.none())
    reward_script = forms.ModelChoiceField(queryset=RewardScript.objects.none())
    config = forms.CharField(widget=forms.Textarea(attrs={"rows": 12, "spellcheck": "false"}),
                             help_text="TrainerConfig as JSON; defaults fill what you leave out")

    def __init__(self, user, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["model"].choices = [
            (m.name, f"{m.name} ({m.origin}, {m.size_bytes / 1e6:.0f} MB)") for m in registry.registered_models()]
        self.fields["harness"].queryset = selectors.owned(Harness.objects.all(), user)
        self.fields["dataset"].queryset = selectors.owned(Dataset.objects.all(), user)
        self.fields["reward_script"].queryset = selectors.owned(RewardScript.objects.all(), user)
        self.fields["config"].initial = json.dumps(TrainerConfig().to_dict(), indent=2)

    def clean_config(self):
        try:
            value = json.loads(self.cleaned_data["config"] or "{}")
        except json.JSONDecodeError as exc:
            raise forms.ValidationError(f"not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})")
        if not isinstance(value, dict):
            raise forms.ValidationError("must be a JSON object of TrainerConfig fields")
        return value
