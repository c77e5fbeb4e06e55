"""Tiny model builder, SmolLM2 import and the model-folder registry."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainer import models
from trainer.model_registry import MARKER, list_models, read_model_info
from trainer.models import build_tiny_model


def test_it_builds_a_loadable_qwen2_with_chatml(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.vocab_size == len(tok) == 1024
    assert [tok.convert_tokens_to_ids(t) for t in models.SPECIAL_TOKENS] == [0, 1, 2]
    assert tok.eos_token == "<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text)["input_ids"]
    assert ids[0] == 1 and tok.decode(ids) == text
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 1024)


def test_it_renders_tool_calls_and_tool_results(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "add"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
        {"role": "tool", "content": "3"},
    ]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools")
    assert '<tools>\n{"type": "function", "function": {"name": "add"' in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
            "</tool_call><|im_end|>\n") in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n")
    assert tok.convert_tokens_to_ids("<tool_call>") == 1022


def test_it_is_byte_identical_for_a_seed_and_differs_across_seeds(tmp_path, tiny_model_dir):
    again = build_tiny_model(tmp_path / "again", seed=0)
    other = build_tiny_model(tmp_path / "other", seed=1)
    files = sorted(p.name for p in tiny_model_dir.iterdir() if p.name != MARKER)
    assert "model.safetensors" in files and "tokenizer.json" in files
    for name in files:
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()


def test_it_lists_model_folders_with_origin_size_and_params(tmp_path, tiny_model_dir):
    build_tiny_model(tmp_path / "b-tiny", seed=3)
    (tmp_path / "a-plain").mkdir()
    (tmp_path / "a-plain" / "config.json").write_text("{}")
    (tmp_path / "not-a-model").mkdir()
    (tmp_path / "stray.txt").write_text("x")
    infos = list_models(tmp_path)
    assert [i.name for i in infos] == ["a-plain", "b-tiny"]
    plain, tiny = infos
    assert (plain.origin, plain.params, plain.size_bytes) == ("unknown", None, 2)
    assert tiny.origin == "tiny" and tiny.params == 427136
    assert tiny.size_bytes == sum(p.stat().st_size for p in (tmp_path / "b-tiny").iterdir())
    assert tiny.path == str((tmp_path / "b-tiny").resolve())
    assert json.loads((tmp_path / "b-tiny" / MARKER).read_text())["seed"] == 3
    assert list_models(tmp_path / "missing") == []
    assert read_model_info(tmp_path / "not-a-model") is None


def test_the_tiny_command_writes_to_the_data_dir(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LIGHTNING_DATA_DIR", str(tmp_path))
    assert models.main(["tiny", "--seed", "2"]) == 0
    assert [i.name for i in list_models(tmp_path / "models")] == ["tiny-qwen2-s2"]
    assert models.main(["list"]) == 0
    listed = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert listed[0]["origin"] == "tiny" and listed[0]["params"] == 427136


def test_smollm2_gguf_is_found_without_importing_the_plugin():
    path = models.smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000


@pytest.mark.slow
def test_it_imports_smollm2_from_gguf_to_safetensors(tmp_path):
    lines = []
    out = models.import_smollm2(tmp_path / "smol", progress=lines.append)
    assert [line[:5] for line in lines[:4]] == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"]
    assert (out / "model.safetensors").is_file() and not list(out.glob("*.gguf"))
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert model.config.model_type == "llama" and model.config.tie_word_embeddings
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nHi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    ids = tok(text, return_tensors="pt")["input_ids"]
    greedy = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
    assert tok.decode(greedy, skip_special_tokens=True).strip() != ""
    info = read_model_info(out)
    assert info.origin == "smollm2-gguf" and 130e6 < info.params < 140e6


def test_logit_transforms_the_trainer_skips_are_named_and_plain_models_pass():
    """Issue 26.7: trainer.policy.token_logprobs takes hidden states through the output embedding itself, so a
    config that transforms the logits after it (soft-capping, scaling) names that; the families we train pass."""
    from transformers import CohereConfig, Gemma2Config, Gemma3TextConfig, GraniteConfig, LlamaConfig, Qwen2Config

    from trainer.model_registry import logit_transform

    assert "final_logit_softcapping=30.0" in logit_transform(Gemma2Config().to_dict())
    assert "logit_scale=0.0625" in logit_transform(CohereConfig().to_dict())
    assert "logits_scaling=8.0" in logit_transform(GraniteConfig(logits_scaling=8.0).to_dict())
    assert "final_logit_softcapping=30.0" in logit_transform(
        {"model_type": "gemma3", "text_config": {"final_logit_softcapping": 30.0}})
    for plain in (Gemma3TextConfig(), GraniteConfig(), LlamaConfig(), Qwen2Config()):
        assert logit_transform(plain.to_dict()) == ""
