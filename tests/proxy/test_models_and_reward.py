"""GET /models, POST /reward and unknown endpoints under /rollouts/<id>/v1/."""
from __future__ import annotations

from tests.proxy.conftest import SERVED


async def test_it_lists_the_served_model_in_openai_and_anthropic_formats(client):
    r = await client.get("/models")
    a = await client.get("/models", headers={"anthropic-version": "2023-06-01"})

    assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == [SERVED]
    assert a.status_code == 200 and a.json()["data"][0]["type"] == "model" and a.json()["has_more"] is False


async def test_it_requires_the_key_for_models(client):
    r = await client.get("/models", headers={"authorization": "Bearer nope"})

    assert r.status_code == 401


async def test_it_stores_a_reported_reward(client, recorder):
    r = await client.post("/reward", json={"reward": 1, "detail": {"tests_passed": 3}})

    assert r.status_code == 200 and r.json() == {"rollout_id": "r1", "reward": 1.0, "detail": {"tests_passed": 3}}
    assert recorder.rewards == [("r1", 1.0, {"tests_passed": 3})]


async def test_it_rejects_a_bad_reward(client, recorder):
    missing = await client.post("/reward", json={"detail": {}})
    text = await client.post("/reward", json={"reward": "high"})
    nan = await client.post("/reward", content=b'{"reward": NaN}', headers={"content-type": "application/json"})

    assert missing.status_code == 400 and missing.json()["error"]["message"] == "missing required field 'reward'"
    assert text.status_code == 400 and text.json()["error"]["message"] == "field 'reward' must be an integer or a number, got str"
    assert nan.status_code == 400 and nan.json()["error"]["message"] == "field 'reward' must be a finite number"
    assert recorder.rewards == []


async def test_it_refuses_rewards_for_a_finished_rollout(client, directory, recorder):
    directory.finish("r1")
    r = await client.post("/reward", json={"reward": 0.5})

    assert r.status_code == 409 and recorder.rewards == []


async def test_it_answers_404_for_unknown_endpoints_in_the_callers_format(client):
    o = await client.post("/embeddings", json={"input": "x"})
    a = await client.post("/messages/batches", json={}, headers={"anthropic-version": "2023-06-01"})

    assert o.status_code == 404 and o.json()["error"]["code"] == "unknown_endpoint"
    assert a.status_code == 404 and a.json()["type"] == "error" and a.json()["error"]["type"] == "not_found_error"
