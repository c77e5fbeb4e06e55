"""A checkpoint is a model folder a run can start from (issue 40.5): it carries its model's tokenizer, and the engine
is served its trained weights alone, never the KL reference or the optimizer state the folder also holds."""
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.trainer.test_scheduler_checkpoints import Engine, Source
from trainer.config import TrainerConfig
from trainer.engine.folders import MARKER, run_weights_folder, shared_served_model
from trainer.policy import OPTIMIZER_DIR, REFERENCE_FILE, Policy
from trainer.scheduler import Scheduler

CONFIG = {"tasks_per_step": 2, "group_size": 2, "steps": 1, "learning_rate": 1e-2, "kl_coef": 0.1,
          "checkpoint_every": 1, "dtype": "float32"}
TINY_TOKENIZER = ("chat_template.jinja", "tokenizer.json", "tokenizer_config.json")
"""What the tiny model's folder holds of a tokenizer (trainer.models.build_tiny_model)."""


async def train_one_step(source, checkpoints, **kwargs):
    """One GRPO step (with a KL reference) of the model in `source`; the checkpoint folder of step 1."""
    policy = Policy(AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32), TrainerConfig(**CONFIG))
    await Scheduler(policy, Engine(), Source(), checkpoint_dir=checkpoints, **kwargs).run()
    return checkpoints / "step-000001"


async def test_a_checkpoint_carries_the_tokenizer_of_the_model_it_was_trained_from(tiny_model_dir, tmp_path):
    checkpoint = await train_one_step(tiny_model_dir, tmp_path, model_dir=tiny_model_dir)
    for name in TINY_TOKENIZER:
        assert (checkpoint / name).read_bytes() == (tiny_model_dir / name).read_bytes()
    loaded, original = AutoTokenizer.from_pretrained(checkpoint), AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "user", "content": "say 3"}]
    assert loaded.apply_chat_template(messages, tokenize=False) == original.apply_chat_template(messages,
                                                                                                tokenize=False)
    assert loaded("hello world").input_ids == original("hello world").input_ids
    assert loaded.eos_token == original.eos_token == "<|im_end|>"


@pytest.fixture
async def trained_checkpoint(tiny_model_dir, tmp_path):
    """A step-1 checkpoint whose weights moved away from its reference, holding the optimizer state and, as a
    checkpoint now does, its model's tokenizer (copied here, so that staging is tested on its own)."""
    checkpoint = await train_one_step(tiny_model_dir, tmp_path / "checkpoints")
    for name in TINY_TOKENIZER:
        shutil.copy2(tiny_model_dir / name, checkpoint / name)
    assert (checkpoint / REFERENCE_FILE).is_file() and (checkpoint / OPTIMIZER_DIR).is_dir()
    return checkpoint


def test_staging_a_checkpoint_serves_its_weights_and_nothing_else(trained_checkpoint, tmp_path):
    trained = load_file(trained_checkpoint / "model.safetensors")
    reference = load_file(trained_checkpoint / REFERENCE_FILE)
    embed = "model.embed_tokens.weight"
    assert (trained[embed] - reference[embed]).abs().max() > 1e-3  # serving the reference would show

    served = shared_served_model(trained_checkpoint, tmp_path / "models")
    staged = load_file(served / "model.safetensors")  # untied: the head is a copy of the trained embedding
    assert set(staged) == set(trained) | {"lm_head.weight"}
    for name, tensor in trained.items():
        assert torch.equal(staged[name], tensor), name
    assert torch.equal(staged["lm_head.weight"], trained[embed])
    assert sorted(p.name for p in served.iterdir()) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", MARKER, *TINY_TOKENIZER])
    weights = run_weights_folder(served, tmp_path / "weights")  # what each weight sync replaces
    assert sorted(p.name for p in weights.iterdir()) == ["config.json", "model.safetensors"]
