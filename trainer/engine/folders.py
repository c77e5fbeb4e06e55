"""Model folders vLLM serves: one shared, untied copy per registry model, and each run's own weights folder.

vLLM starts from the shared folder (config, tokenizer, weights), so repeated runs of a model pay the untie
once and start from the same path. Weight sync never writes there: it replaces the files of the run's weights
folder (hard links into the shared folder until the first sync) and makes vLLM reload from that folder.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from trainer.engine.sync import stage_model

LAYOUT = "untied-v1"
"""Changes when what a shared folder holds changes, so folders built the old way are not reused."""
MARKER = ".served-from.json"
"""Written last into a shared folder: its presence means the folder is complete."""
WEIGHT_FILES = ("config.json", "*.safetensors", "*.safetensors.index.json")
"""What a run's weights folder holds: the config (write_weights reads whether it is tied) and the weights."""


def fingerprint(source: Path, dtype: str | None = None) -> str:
    """Short hash of the source folder's path, of each file's name, size and modification time, and of the dtype
    the folder serves in (None: the source's own)."""
    digest = hashlib.sha256(f"{LAYOUT}\0{source.resolve()}".encode())
    if dtype is not None:
        digest.update(f"\0dtype={dtype}".encode())
    for item in sorted(source.rglob("*")):
        if item.is_file():
            stat = item.stat()
            digest.update(f"\0{item.relative_to(source)}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:12]


def served_folder(source: str | Path, root: str | Path, dtype: str | None = None) -> Path:
    """Where the shared served folder of `source` in `dtype` is (or will be) under `root`."""
    source = Path(source).resolve()
    return Path(root) / f"{source.name}-{fingerprint(source, dtype)}"


def shared_served_model(source: str | Path, root: str | Path, dtype: str | None = None) -> Path:
    """The folder vLLM serves for `source`, built under `root` on first use and reused while the source is unchanged.
    Its weights are in `dtype` (the engine's: 'bfloat16', 'float32'), or the source's own when None.

    Built in a temporary folder and renamed into place, so a start racing another one sees either nothing or a
    complete folder. A re-imported model (other files or times) gets a new folder; old ones stay until removed.
    """
    source, root = Path(source).resolve(), Path(root)
    final = served_folder(source, root, dtype)
    if (final / MARKER).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    try:
        stage_model(source, building, dtype)
        (building / MARKER).write_text(json.dumps({"source": str(source), "layout": LAYOUT, "dtype": dtype}) + "\n")
        if final.exists() and not (final / MARKER).is_file():
            shutil.rmtree(final)  # left half-built by a crash before the marker existed
        try:
            os.rename(building, final)
        except OSError:
            if not (final / MARKER).is_file():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)  # gone already when the rename won
    return final


def run_weights_folder(served: str | Path, dest: str | Path) -> Path:
    """The run's own weights folder, reset to links of the served folder's config and weights (what vLLM loads
    at start). Sync renames new files over these links, so the shared files are never written."""
    served, dest = Path(served), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for pattern in WEIGHT_FILES:
        for stale in dest.glob(pattern):
            stale.unlink()
    for pattern in WEIGHT_FILES:
        for item in served.glob(pattern):
            try:
                os.link(item, dest / item.name)
            except OSError:
                shutil.copy2(item, dest / item.name)
    return dest
