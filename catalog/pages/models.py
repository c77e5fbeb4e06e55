"""The models page: the registry (shared by every user) and its imports, which run in the background."""
from __future__ import annotations

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import JsonResponse
from django.shortcuts import redirect, render
from django.urls import path, reverse
from django.views.decorators.http import require_GET, require_POST

from catalog import model_imports
from catalog.registry import registered_models


class TinyImportForm(forms.Form):
    name = forms.RegexField(model_imports.NAME_PATTERN, max_length=100, initial="tiny-2",
                            error_messages={"invalid": "use letters, digits, '.', '_' or '-', starting with a letter "
                                                       "or digit (it names the model's folder)"},
                            help_text="The model's registry name and folder name.")
    seed = forms.IntegerField(min_value=0, max_value=2**32 - 1, initial=0,
                              help_text="Weights are random but fixed by the seed: the same seed gives the same model.")


class GGUFImportForm(forms.Form):
    """A GGUF import (SmolLM2, Gemma 3): its registry name is fixed, only the saved weights' dtype is chosen."""

    dtype = forms.ChoiceField(label="Weight type", choices=[(d, d) for d in model_imports.DTYPES], initial="bfloat16",
                              help_text="dtype of the saved weights.")


FORMS = {"tiny": TinyImportForm, "smollm2": GGUFImportForm, "gemma3": GGUFImportForm}
GGUF_CARDS = {"smollm2": ("SmolLM2-135M-Instruct", "About a minute."),
              "gemma3": ("Gemma 3 270M (base)", "One to two minutes. The base model, given Gemma's turn format: it "
                                                "follows a format best with demonstration turns in the prompt.")}
"""Title and note of each GGUF import's card on the page, in page order."""


def import_form(kind: str, data=None) -> forms.Form:
    """The import form of `kind`; the GGUF cards share one form class, so their field ids carry the kind."""
    return FORMS[kind](data, auto_id="id_%s" if kind == "tiny" else f"id_{kind}_%s")


@login_required
def model_list(request, forms_by_kind=None):
    forms_by_kind = {kind: import_form(kind) for kind in FORMS} | (forms_by_kind or {})
    models = [{**info.to_dict(), "params_human": human_count(info.params)} for info in registered_models()]
    gguf_cards = [{"kind": kind, "title": title, "note": note, "form": forms_by_kind[kind],
                   "registry_name": model_imports.GGUF_IMPORTS[kind][0], "description": model_imports.KINDS[kind],
                   "action": reverse(f"model-import-{kind}")} for kind, (title, note) in GGUF_CARDS.items()]
    return render(request, "resources/model_list.html", {
        "models": models, "imports": model_imports.recent_statuses(), "forms": forms_by_kind,
        "gguf_cards": gguf_cards, "kinds": model_imports.KINDS,
    })


@login_required
@require_POST
def model_import(request, kind: str):
    """Start an import; a taken name or a running import of it is refused beside the form, with the reason."""
    form = import_form(kind, request.POST)
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
    path("models/import/gemma3/", model_import, {"kind": "gemma3"}, name="model-import-gemma3"),
    path("models/imports/status/", model_import_status, name="model-import-status"),
]
