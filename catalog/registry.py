"""The models registry: model folders under the models dir, and what a run's `model` field may name."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from django.conf import settings

from trainer.model_registry import ModelInfo, UnsupportedModel, check_trainable, list_models, read_model_info


class UnknownModel(ValueError):
    pass


class ModelNotAllowed(UnknownModel):
    """A model folder outside the registry and the user's own checkpoints."""


def registered_models() -> list[ModelInfo]:
    return list_models(settings.LIGHTNING_MODELS_DIR)


def resolve_model(model: str, owner) -> dict[str, Any]:
    """A registry name, a model folder `owner` may use (see check_model_path), or an external OpenAI-compatible URL."""
    if model.startswith(("http://", "https://")):
        return {"name": model, "path": "", "origin": "external", "url": model, "weight_sync": False}
    for info in registered_models():
        if info.name == model:  # a folder linked into the registry from elsewhere is refused like its target
            folder = check_model_path(owner, info.path)
            _check_trainable(folder)
            return {**info.to_dict(), "path": str(folder), "weight_sync": True}
    if Path(model).is_absolute():
        folder = check_model_path(owner, model)
        info = read_model_info(folder)
        if info is not None:
            _check_trainable(folder)
            return {**info.to_dict(), "weight_sync": True}
        raise UnknownModel(f"{model} is not a folder holding a transformers model (no config.json)")
    names = [info.name for info in registered_models()]
    raise UnknownModel(f"model {model!r} is not in the registry (available: {names or 'none'}); "
                       "import one with `./lw manage models smollm2` or `./lw manage models tiny`, "
                       "or give the path of a checkpoint of one of your runs, or an external engine URL")


def _check_trainable(folder: Path) -> None:
    try:
        check_trainable(folder)
    except UnsupportedModel as exc:
        raise UnknownModel(str(exc)) from exc


def check_model_path(owner, path: str | os.PathLike) -> Path:
    """`path` with symlinks and '..' resolved, if it lies in the models registry or in a checkpoint of one of
    `owner`'s runs (LIGHTNING_RUNS_DIR/run-<id>/checkpoints/...); ModelNotAllowed otherwise."""
    folder = Path(os.path.realpath(path))
    registry = Path(os.path.realpath(settings.LIGHTNING_MODELS_DIR))
    if folder.is_relative_to(registry) and folder != registry:
        return folder
    run_id = _checkpoint_run_id(folder)
    if run_id is not None and owner is not None:
        from runs.models import Run

        if Run.objects.filter(pk=run_id, owner=owner).exists():
            return folder
    raise ModelNotAllowed(
        f"model folder {path} is not allowed: a run's model must be a registry model (under "
        f"{settings.LIGHTNING_MODELS_DIR}, see /api/v1/models/) or a checkpoint of one of your own runs "
        f"({settings.LIGHTNING_RUNS_DIR}/run-<id>/checkpoints/step-NNNNNN)")


def _checkpoint_run_id(folder: Path) -> int | None:
    """The run id of a folder under LIGHTNING_RUNS_DIR/run-<id>/checkpoints/, else None."""
    runs_dir = Path(os.path.realpath(settings.LIGHTNING_RUNS_DIR))
    if not folder.is_relative_to(runs_dir):
        return None
    parts = folder.relative_to(runs_dir).parts
    if len(parts) < 3 or parts[1] != "checkpoints" or not parts[0].startswith("run-"):
        return None
    number = parts[0].removeprefix("run-")
    return int(number) if number.isdigit() else None
