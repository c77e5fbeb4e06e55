"""The real vLLM server from the engine venv: token ids, weight sync, pause/resume, logprob agreement."""
import threading
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from common.procs import group_alive
from trainer.engine import EngineConfig, VLLMEngine, default_engine_venv, managed_engine
from trainer.engine.startup import NAMES
from trainer.packing import pack
from trainer.policy import token_logprobs
from trainer.samples import Sample

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not (default_engine_venv() / "bin" / "python").exists(),
                       reason=f"no engine venv at {default_engine_venv()}: run scripts/setup-engine"),
]
PROMPT = [{"role": "user", "content": "What is 12 * 34? Answer with CALC: then the numbers."}]


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    config = EngineConfig(model_path=str(tiny_model_dir), served_model_name="tiny", max_model_len=1024,
                          kv_cache_gb=0.25, dtype="float32")  # "auto" would downcast to bfloat16 on CPU
    reports = []
    with managed_engine(config, tmp_path_factory.mktemp("engine"), start_timeout=600,
                        on_progress=lambda phase, fraction: reports.append((phase, fraction))) as engine:
        engine.progress_reports = reports
        yield engine


def chat(engine, max_tokens=12, **extra):
    body = {"model": "tiny", "messages": PROMPT, "max_tokens": max_tokens, "temperature": 0.0,
            "logprobs": True, "return_token_ids": True, **extra}
    response = httpx.post(f"{engine.base_url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def engine_vs_trainer_logprobs(reply, model):
    """(engine logprobs, trainer logprobs) of the sampled tokens, both (T,) float64."""
    prompt, completion = reply["prompt_token_ids"], reply["choices"][0]["token_ids"]
    engine_lp = [t["logprob"] for t in reply["choices"][0]["logprobs"]["content"]]
    sample = Sample(tuple(prompt + completion), (0,) * len(prompt) + (1,) * len(completion),
                    (0.0,) * len(prompt) + tuple(engine_lp), (-1,) * len(prompt) + (0,) * len(completion),
                    (), (0,), "single")
    with torch.no_grad():
        trainer_lp, _ = token_logprobs(model, pack([sample]))
    return torch.tensor(engine_lp, dtype=torch.float64), trainer_lp.double()


def is_paused(engine) -> bool:
    return httpx.get(f"{engine.base_url}/is_paused").json()["is_paused"]


def served_state(engine):
    return load_file(engine.sync.model_dir / "model.safetensors")


def perturbed(state, seed):
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.3 * torch.randn(v.shape, generator=gen) for k, v in state.items()}


def test_a_real_start_reports_every_phase_from_the_vllm_log(engine):
    assert list(engine.server.start_timings) == list(NAMES)  # each phase's line was found in vLLM's own log
    phases = [NAMES.index(phase) for phase, _ in engine.progress_reports]
    fractions = [fraction for _, fraction in engine.progress_reports]
    assert phases == sorted(phases) and fractions == sorted(fractions)
    assert engine.progress_reports[0] == ("launching", 0.0) and engine.progress_reports[-1] == ("ready", 1.0)
    assert len(engine.progress_reports) >= len(NAMES)


def test_it_serves_token_ids_and_logprobs_under_the_served_name(engine):
    models = httpx.get(f"{engine.base_url}/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["tiny"]
    reply = chat(engine)
    choice = reply["choices"][0]
    assert reply["prompt_token_ids"][:1] == [1]  # <|im_start|>
    assert len(choice["token_ids"]) == len(choice["logprobs"]["content"]) == reply["usage"]["completion_tokens"]
    assert all(t["logprob"] <= 0 for t in choice["logprobs"]["content"])
    assert engine.version == 0 and engine.sync.version() is None  # base weights, no version tagged yet


def test_engine_and_trainer_logprobs_agree_for_the_same_weights(engine, tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    engine_lp, trainer_lp = engine_vs_trainer_logprobs(chat(engine, max_tokens=24), model)
    diff = (engine_lp - trainer_lp).abs().max().item()
    print(f"\nLOGPROB AGREEMENT base weights: max |engine - trainer| = {diff:.2e} over {len(engine_lp)} tokens "
          "(vLLM float32, trainer float32)")
    assert diff < 1e-3


async def test_a_weight_sync_changes_greedy_output_and_tags_the_version(engine, tiny_model_dir):
    base = chat(engine, max_tokens=16)["choices"][0]["token_ids"]
    original = served_state(engine)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.load_state_dict(perturbed(original, seed=1), strict=False)
    model.tie_weights()

    await engine.pause()
    assert is_paused(engine)
    await engine.update_weights(model, version=1)
    await engine.resume()
    assert engine.version == 1 and engine.sync.version() == 1 and not is_paused(engine)

    reply = chat(engine, max_tokens=24)
    assert reply["choices"][0]["token_ids"][:16] != base
    shared = load_file(Path(engine.server.config.model_path) / "model.safetensors")  # what every run starts from
    assert all(torch.equal(shared[k], original[k]) for k in original)  # the sync went to the run's own folder
    engine_lp, trainer_lp = engine_vs_trainer_logprobs(reply, model)
    diff = (engine_lp - trainer_lp).abs().max().item()
    print(f"\nLOGPROB AGREEMENT after sync: max |engine - trainer| = {diff:.2e} over {len(engine_lp)} tokens "
          "(vLLM float32, trainer float32)")
    assert diff < 1e-3

    await engine.pause()
    await engine.update_weights(original, version=2)  # a state dict round trip restores the base behaviour
    await engine.resume()
    assert chat(engine, max_tokens=16)["choices"][0]["token_ids"] == base
    assert VLLMEngine(engine.sync).version == 2  # a new adapter reads the version back from the engine


def test_calls_sent_while_paused_wait_for_resume(engine):
    engine.sync.pause()
    done = threading.Event()
    result = {}

    def call():
        result["reply"] = chat(engine, max_tokens=4)
        done.set()

    worker = threading.Thread(target=call)
    try:
        worker.start()
        assert not done.wait(3.0), "a call completed while the engine was paused"
    finally:
        engine.sync.resume()
    worker.join(120)
    assert done.is_set() and len(result["reply"]["choices"][0]["token_ids"]) == 4


def test_stop_leaves_no_process_of_the_group(engine):
    server = engine.server
    pgid = server.pgid
    assert group_alive(pgid) and server.health()
    server.stop()
    assert not group_alive(pgid) and not server.health()


async def test_smollm2_imported_from_gguf_serves_and_reloads_in_vllm(tmp_path):
    from trainer.models import import_smollm2

    model_dir = import_smollm2(tmp_path / "smollm2")
    config = EngineConfig(model_path=str(model_dir), served_model_name="smollm2", max_model_len=1024,
                          kv_cache_gb=0.5, extra_args=("--enforce-eager",))  # skips a minute of compiling
    with managed_engine(config, tmp_path / "engine", start_timeout=600) as engine:
        body = {"model": "smollm2", "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 16, "temperature": 0.0, "return_token_ids": True}
        first = httpx.post(f"{engine.base_url}/v1/chat/completions", json=body, timeout=300).json()
        assert first["prompt_token_ids"][0] == 1  # <|im_start|>, then SmolLM2's default system prompt
        assert first["choices"][0]["message"]["content"].strip()
        assert first["choices"][0]["finish_reason"] in ("stop", "length")
        await engine.pause()
        await engine.update_weights(served_state(engine), version=7)
        await engine.resume()
        again = httpx.post(f"{engine.base_url}/v1/chat/completions", json=body, timeout=300).json()
        assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
        assert engine.sync.version() == 7


def test_an_engine_limited_to_avx2_never_loads_code_compiled_without_the_limit(tiny_model_dir, tmp_path):
    """Seen before each ISA had a cache folder of its own: float32 compiled without a limit, then served under
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 from the same cache, answered every logprobs call 400 (NaN)."""
    from trainer.host import ISA_LIMITS

    cache = tmp_path / "cache"  # fresh: the first start compiles into it, the second must not reuse that
    for index, extra_env in enumerate(({}, ISA_LIMITS["avx2"])):
        config = EngineConfig(model_path=str(tiny_model_dir), served_model_name="tiny", max_model_len=1024,
                              kv_cache_gb=0.25, dtype="float32", cache_dir=str(cache), extra_env=extra_env)
        with managed_engine(config, tmp_path / f"engine-{index}", start_timeout=600) as engine:
            reply = chat(engine, temperature=0.7)
            logprobs = [t["logprob"] for t in reply["choices"][0]["logprobs"]["content"]]
            assert len(logprobs) == 12 and all(-100 < lp <= 0 for lp in logprobs)
    assert len(list((cache / "inductor").iterdir())) == 2  # one compile cache per ISA setting
