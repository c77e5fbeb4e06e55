"""Model-folder registry: the marker of each folder, the listing of a models dir, which models the trainer can train."""
from __future__ import annotations

import json
import logging
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

MARKER = "lightning_model.json"
"""File written into every model folder we build or import; the registry reads it."""


@dataclass(frozen=True)
class ModelInfo:
    """One model folder as the registry lists it."""

    name: str
    path: str
    size_bytes: int
    origin: str
    params: int | None
    created: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def write_marker(folder: Path, name: str, origin: str, params: int | None, extra: dict | None = None) -> None:
    """Record name, origin and size of a model folder (written last: its presence means the folder is complete)."""
    data = {"name": name, "origin": origin, "params": params,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **(extra or {})}
    tmp = Path(tempfile.mktemp(prefix=".marker-", dir=folder))
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(folder / MARKER)


def folder_size(folder: Path) -> int:
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())


def read_model_info(folder: str | Path) -> ModelInfo | None:
    """ModelInfo for one folder holding a transformers model (config.json), else None."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        return None
    marker = {}
    if (folder / MARKER).is_file():
        try:
            marker = json.loads((folder / MARKER).read_text())
        except (OSError, ValueError):
            logger.warning("unreadable %s in %s", MARKER, folder, exc_info=True)
    return ModelInfo(
        name=marker.get("name") or folder.name,
        path=str(folder.resolve()),
        size_bytes=folder_size(folder),
        origin=marker.get("origin", "unknown"),
        params=marker.get("params"),
        created=marker.get("created"),
    )


def list_models(root: str | Path) -> list[ModelInfo]:
    """Every model folder directly under root (imported, built or checkpointed), sorted by name."""
    root = Path(root)
    if not root.is_dir():
        return []
    infos = [read_model_info(child) for child in sorted(root.iterdir()) if child.is_dir()]
    return sorted((i for i in infos if i is not None), key=lambda i: i.name)


# --- what the trainer can train ---------------------------------------------------------------------

LOGIT_TRANSFORMS: tuple[tuple[str, object], ...] = (
    ("final_logit_softcapping", None),  # Gemma 2 (and Gemma 3 where set): tanh soft-capping of the logits
    ("logit_scale", 1.0),  # Cohere: logits multiplied by it
    ("logits_scaling", 1.0),  # Granite: logits divided by it
    ("lm_head_multiplier", 1.0),  # Falcon-H1: logits multiplied by it
    ("dim_model_base", None),  # MiniCPM: hidden states scaled by hidden_size / dim_model_base before the head
)
"""Config fields (with their neutral value) of transformations a model's own forward applies to its logits after
the output embedding. trainer.policy.token_logprobs takes the decoder's hidden states through the output embedding
itself and skips them, so it would score tokens under another distribution than vLLM samples from."""


def logit_transform(config: dict) -> str:
    """'' when the trainer's logprobs are the model's; else which logit transformation it would skip (a model
    to refuse). `config` is a config.json dict; a multimodal one's text_config is checked too."""
    for part in (config, config.get("text_config") or {}):
        for name, neutral in LOGIT_TRANSFORMS:
            value = part.get(name, neutral)
            if value in (neutral, None):
                continue
            return (f"its config sets {name}={value!r}, a transformation of the logits that the trainer does not "
                    "apply (it takes the decoder's hidden states through the output embedding itself), so it would "
                    "train on other token probabilities than the engine samples from")
    return ""


class UnsupportedModel(ValueError):
    """A model whose logits the trainer cannot reproduce (see logit_transform)."""


def check_trainable(folder: str | Path) -> None:
    """UnsupportedModel unless the trainer computes the model's own token probabilities (see logit_transform)."""
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UnsupportedModel(f"{path} cannot be read: {exc}") from exc
    reason = logit_transform(config)
    if reason:
        raise UnsupportedModel(f"model {Path(folder).name} is refused: {reason}")

