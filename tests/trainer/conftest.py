"""Shared trainer-test fixtures: the tiny test model, built once per session."""
from pathlib import Path

import pytest

from trainer.models import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A deterministic tiny Qwen2 model folder (seed 0): safetensors, tokenizer, ChatML template."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", seed=0)
