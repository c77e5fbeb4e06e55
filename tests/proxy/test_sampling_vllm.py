"""A greedy evaluation rollout through the proxy in front of a real vLLM: temperature 0 with logprobs, beside
rollouts sampled at the run's temperature in the same engine batch."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from proxy.app import create_app
from proxy.sampling import GREEDY
from proxy.types import InMemoryDirectory, InMemoryRecorder, UpstreamConfig
from trainer.engine import EngineConfig, VLLMServer, default_engine_venv

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not (default_engine_venv() / "bin" / "python").exists(),
                       reason=f"no engine venv at {default_engine_venv()}: run scripts/setup-engine"),
]
RUN = {"temperature": 0.7, "top_p": 1.0, "top_k": -1}
BODY = {"model": "any", "messages": [{"role": "user", "content": "What is 12 + 34?"}], "max_tokens": 24,
        "temperature": 1.0}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from trainer.models import build_tiny_model

    tiny = build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", seed=0)
    config = EngineConfig(model_path=str(tiny), served_model_name="tiny", max_model_len=512, kv_cache_gb=0.25,
                          dtype="float32")
    server = VLLMServer(config, log_path=tmp_path_factory.mktemp("engine") / "engine.log").start(timeout=600)
    yield server
    server.stop()


async def test_greedy_rollouts_get_argmax_answers_with_logprobs_beside_sampled_ones(engine):
    directory, recorder = InMemoryDirectory(), InMemoryRecorder()
    for i in range(2):
        directory.add(f"g{i}", "s", sampling=GREEDY, split="val")
    for i in range(4):
        directory.add(f"s{i}", "s", split="val")
    app = create_app(directory, recorder, UpstreamConfig(base_url=engine.base_url + "/v1", served_model="tiny",
                                                         sampling=RUN))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), timeout=120,
                                 headers={"authorization": "Bearer s"}) as http:

        async def call(rollout_id: str) -> int:
            return (await http.post(f"http://proxy/rollouts/{rollout_id}/v1/chat/completions", json=BODY)).status_code

        assert await call("g0") == 200  # alone
        assert await asyncio.gather(call("g1"), *(call(f"s{i}") for i in range(4))) == [200] * 5  # one mixed batch
    await app.aclose()

    calls = {c.rollout_id: c for c in recorder.calls}
    for rollout_id, call in calls.items():
        assert call.upstream_request["temperature"] == (0.0 if rollout_id.startswith("g") else 0.7)
        assert call.sampling_overrides == {"temperature": 1.0}
        assert call.completion_ids and len(call.logprobs) == len(call.completion_ids)
        assert all(lp <= 0.0 for lp in call.logprobs)
    # Temperature 0 is argmax: the same prompt gives the same tokens, alone or batched with sampled calls.
    assert calls["g1"].completion_ids == calls["g0"].completion_ids
