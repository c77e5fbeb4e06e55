"""In-process stand-ins for tests and benchmarks: a tiny random Qwen2, a torch sampling engine, a harness source."""
from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


def tiny_qwen2(vocab_size: int = 64, hidden_size: int = 64, layers: int = 2, seed: int = 0) -> Qwen2ForCausalLM:
    """A deterministic randomly initialised Qwen2 over integer tokens (no tokenizer needed)."""
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=True, attention_dropout=0.0)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    return model
