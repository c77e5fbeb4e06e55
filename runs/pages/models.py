"""The models page: the registry (shared by every user) and its imports, which run in the background."""
from __future__ import annotations

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import JsonResponse
from django.shortcuts import redirect, render
from django.urls import path
from django.views.decorators.http import require_GET, require_POST

from runs import model_imports
from runs.registry import registered_models


class TinyImportForm(forms.Form):
    name = forms.RegexField(model_imports.NAME_PATTERN, max_length=100, initial="tiny-2",
                            error_messages={"invalid": "use letters, digits, '.', '_' or '-', starting with a letter "
                                                       "or digit (it names the model's folder)"},
                            help_text="The model's registry name and folder name.")
    seed = forms.IntegerField(min_value=0, max_value=2**32 - 1, initial=0,
                              help_text="Weights are random but fixed by the seed: the same seed gives the same model.")


class SmolImportForm(forms.Form):
    dtype = forms.ChoiceField(label="Weight type", choices=[(d, d) for d in model_imports.DTYPES], initial="bfloat16",
                              help_text="dtype of the saved weights.")


FORMS = {"tiny": TinyImportForm, "smollm2": SmolImportForm}


@login_required
def model_list(request, forms_by_kind=None):
    forms_by_kind = {kind: form() for kind, form in FORMS.items()} | (forms_by_kind or {})
    models = [{**info.to_dict(), "params_human": human_count(info.params)} for info in registered_models()]
    return render(request, "resources/model_list.html", {
        "models": models, "imports": model_imports.recent_statuses(), "forms": forms_by_kind,
        "smollm2_name": model_imports.SMOLLM2, "kinds": model_imports.KINDS,
    })


@login_required
@require_POST
def model_import(request, kind: str):
    """Start an import; a taken name or a running import of it is refused beside the form, with the reason."""
    form = FORMS[kind](request.POST)
    if not form.is_valid():
        return model_list(request, {kind: form})
    try:
        status = model_imports.start_import(request.user, kind, **form.cleaned_data)
    except model_imports.ImportRefused as exc:
        form.add_error(None, str(exc))
        return model_list(request, {kind: form})
    messages.success(request, f"Import of {status['name']!r} started: its progress shows below.")
    return redirect("model-list")


@login_required
@require_GET
def model_import_status(request):
    """Every recent import's state for the page's poller (static/js/model_imports.js)."""
    return JsonResponse({"imports": [_public(s) for s in model_imports.recent_statuses()],
                         "models": [info.name for info in registered_models()]})


def _public(status: dict) -> dict:
    return {key: status.get(key) for key in ("name", "kind", "state", "message", "error", "user", "created",
                                             "updated", "log")}


def human_count(n: int | None) -> str:
    """1234567 -> '1.2M': parameter counts as people say them."""
    if n is None:
        return "?"
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


urlpatterns = [
    path("models/", model_list, name="model-list"),
    path("models/import/tiny/", model_import, {"kind": "tiny"}, name="model-import-tiny"),
    path("models/import/smollm2/", model_import, {"kind": "smollm2"}, name="model-import-smollm2"),
    path("models/imports/status/", model_import_status, name="model-import-status"),
]
