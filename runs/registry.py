"""The models registry: model folders under the models dir, and what a run's `model` field may name."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings

from trainer.models import ModelInfo, list_models, read_model_info


class UnknownModel(ValueError):
    pass


def registered_models() -> list[ModelInfo]:
    return list_models(settings.LIGHTNING_MODELS_DIR)


def resolve_model(model: str) -> dict[str, Any]:
    """A registry name, a folder holding a transformers model, or an external OpenAI-compatible URL."""
    if model.startswith(("http://", "https://")):
        return {"name": model, "path": "", "origin": "external", "url": model, "weight_sync": False}
    for info in registered_models():
        if info.name == model:
            return {**info.to_dict(), "weight_sync": True}
    if Path(model).is_absolute():
        info = read_model_info(model)
        if info is not None:
            return {**info.to_dict(), "weight_sync": True}
        raise UnknownModel(f"{model} is not a folder holding a transformers model (no config.json)")
    names = [info.name for info in registered_models()]
    raise UnknownModel(f"model {model!r} is not in the registry (available: {names or 'none'}); "
                       "import one with `./lw manage models smollm2` or `./lw manage models tiny`, "
                       "or give a model folder path or an external engine URL")
