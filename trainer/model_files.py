"""Which files of a model folder make the model: what the engine is served, and what a checkpoint carries to be one.

A checkpoint folder (trainer.policy.save_checkpoint) also holds the trainer's own state: the optimizer, the RNG,
and `reference.safetensors` (the KL term's frozen weights). vLLM loads every *.safetensors of the folder it serves,
so staging copies only the files named here (issue 40.5: a run started from a checkpoint served the reference).
"""
from __future__ import annotations

import shutil
from pathlib import Path

CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja",
                   "chat_template.json")
"""What transformers' tokenizers save (fast and slow, BPE and SentencePiece) and their chat templates."""
VOCABULARIES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
"""Any one of these makes a folder's tokenizer loadable (tokenizer_config.json alone does not)."""
WEIGHT_PATTERNS = ("model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json")
"""The model's own weights: one file, or HF shards and their index."""


def tokenizer_files(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    return [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]


def served_files(folder: str | Path) -> list[Path]:
    """The files of `folder` a served copy of it holds: config, generation config, tokenizer and model weights."""
    folder = Path(folder)
    named = [folder / name for name in CONFIG_FILES if (folder / name).is_file()]
    weights = sorted({path for pattern in WEIGHT_PATTERNS for path in folder.glob(pattern) if path.is_file()})
    return named + tokenizer_files(folder) + weights


def has_tokenizer(folder: str | Path) -> bool:
    return any((Path(folder) / name).is_file() for name in VOCABULARIES)


def copy_tokenizer(source: str | Path, dest: str | Path) -> list[Path]:
    """Copy the tokenizer files of model folder `source` into `dest` (a checkpoint: it becomes a model folder a run
    can start from); the copies. Copied, not linked: the checkpoint outlives a re-import of its model."""
    return [Path(shutil.copy2(path, Path(dest) / path.name)) for path in tokenizer_files(source)]
