"""Admission: rollout secrets (Bearer and x-api-key), unknown and finished rollouts, isolation between rollouts."""
from __future__ import annotations

import hashlib

import httpx
import pytest

from proxy.auth import hash_secret, key_matches

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"model": "claude", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}


def test_it_hashes_secrets_with_sha256_hex():
    assert hash_secret("s1") == hashlib.sha256(b"s1").hexdigest()
    assert key_matches("s1", hash_secret("s1")) and not key_matches("s2", hash_secret("s1"))
    assert not key_matches(None, hash_secret("s1")) and not key_matches("", hash_secret(""))


@pytest.mark.parametrize("auth", [{}, {"authorization": "Bearer wrong"}, {"x-api-key": "wrong"}, {"authorization": "Basic s1"}])
async def test_it_answers_401_in_openai_format_for_a_missing_or_wrong_key(proxy, recorder, fake, auth):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=proxy), base_url="http://proxy") as c:
        r = await c.post("/rollouts/r1/v1/chat/completions", json=CHAT, headers=auth)

    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error" and r.json()["error"]["code"] == "invalid_api_key"
    assert recorder.calls == [] and fake.requests == []


async def test_it_answers_401_in_anthropic_format_on_messages(proxy, recorder):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=proxy), base_url="http://proxy") as c:
        r = await c.post("/rollouts/r1/v1/messages", json=MESSAGES, headers={"x-api-key": "nope"})

    assert r.status_code == 401
    assert r.json() == {"type": "error", "error": {"type": "authentication_error",
                                                    "message": "missing or invalid API key for this rollout"}}
    assert recorder.calls == []


async def test_it_accepts_x_api_key_and_bearer(proxy, recorder):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=proxy), base_url="http://proxy") as c:
        a = await c.post("/rollouts/r1/v1/messages", json=MESSAGES, headers={"x-api-key": "s1"})
        b = await c.post("/rollouts/r1/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer s1"})

    assert (a.status_code, b.status_code) == (200, 200)
    assert [c.api for c in recorder.calls] == ["messages", "chat"]


async def test_it_answers_404_for_an_unknown_rollout(proxy, recorder):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=proxy), base_url="http://proxy") as c:
        r = await c.post("/rollouts/nope/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer s1"})
        m = await c.post("/rollouts/nope/v1/messages", json=MESSAGES, headers={"x-api-key": "s1"})

    assert r.status_code == 404 and r.json()["error"]["code"] == "rollout_not_found"
    assert m.status_code == 404 and m.json()["error"]["type"] == "not_found_error"
    assert recorder.calls == []


async def test_it_answers_409_once_the_rollout_is_finished(client, directory, recorder):
    ok = await client.post("/chat/completions", json=CHAT)
    directory.finish("r1")
    r = await client.post("/chat/completions", json=CHAT)

    assert ok.status_code == 200
    assert r.status_code == 409 and r.json()["error"]["code"] == "rollout_finished"
    assert len(recorder.calls) == 1


async def test_it_never_lets_one_rollout_write_into_another(proxy, recorder):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=proxy), base_url="http://proxy") as c:
        r = await c.post("/rollouts/r1/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer s2"})
        w = await c.post("/rollouts/r1/v1/reward", json={"reward": 1.0}, headers={"authorization": "Bearer s2"})
        own = await c.post("/rollouts/r2/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer s2"})

    assert (r.status_code, w.status_code, own.status_code) == (401, 401, 200)
    assert [(c.rollout_id, c.seq) for c in recorder.calls] == [("r2", 5)]
    assert recorder.rewards == []


async def test_it_accepts_the_right_key_in_either_header_when_both_are_sent(proxy, recorder):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=proxy), base_url="http://proxy") as c:
        r = await c.post("/rollouts/r1/v1/messages", json=MESSAGES,
                         headers={"authorization": "Bearer placeholder", "x-api-key": "s1"})

    assert r.status_code == 200 and [c.rollout_id for c in recorder.calls] == ["r1"]


# --- authentication before routing: a caller without the key learns nothing about the paths served ------------

WRONG_KEYS = pytest.mark.parametrize("auth", [{}, {"authorization": "Bearer wrong"}, {"x-api-key": "s2"}])


@WRONG_KEYS
@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/rollouts/r1/v1/embeddings"), ("GET", "/rollouts/r1/v1/files/f1"), ("GET", "/rollouts/r1/v1/chat/completions"),
    ("POST", "/rollouts/r1/admin"), ("GET", "/rollouts/r1/"), ("OPTIONS", "/rollouts/r1/v1/messages"),
    ("PROPFIND", "/rollouts/r1/v1/reward"),
])
async def test_it_answers_401_before_routing_an_unknown_path_without_the_key(proxy, recorder, fake, auth, method, path):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=proxy), base_url="http://proxy") as c:
        r = await c.request(method, path, json=CHAT, headers=auth)

    assert r.status_code == 401
    assert r.json() == {"error": {"message": "missing or invalid API key for this rollout",
                                  "type": "authentication_error", "param": None, "code": "invalid_api_key"}}
    assert recorder.calls == [] and recorder.rewards == [] and fake.requests == []


async def test_it_answers_401_in_anthropic_format_on_an_unknown_path(proxy, recorder):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=proxy), base_url="http://proxy") as c:
        r = await c.post("/rollouts/r1/v1/messages/batches", json=MESSAGES,
                         headers={"x-api-key": "nope", "anthropic-version": "2023-06-01"})

    assert r.status_code == 401
    assert r.json() == {"type": "error", "error": {"type": "authentication_error",
                                                    "message": "missing or invalid API key for this rollout"}}
    assert recorder.calls == []


@pytest.mark.parametrize(("method", "path", "endpoint"), [
    ("POST", "/rollouts/r1/v1/embeddings", "/v1/embeddings"), ("GET", "/rollouts/r1/v1/chat/completions",
                                                               "/v1/chat/completions"),
    ("POST", "/rollouts/r1/admin", "/admin"), ("DELETE", "/rollouts/r1/", "/"),
])
async def test_it_still_answers_404_for_an_unknown_path_with_the_key(proxy, recorder, fake, method, path, endpoint):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=proxy), base_url="http://proxy") as c:
        r = await c.request(method, path, json=CHAT, headers={"authorization": "Bearer s1"})

    assert r.status_code == 404
    assert r.json() == {"error": {"message": f"unknown endpoint '{endpoint}'", "type": "not_found_error",
                                  "param": None, "code": "unknown_endpoint"}}
    assert recorder.calls == [] and fake.requests == []


async def test_it_still_answers_405_for_a_method_a_known_path_does_not_serve(proxy, recorder):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=proxy), base_url="http://proxy") as c:
        r = await c.request("OPTIONS", "/rollouts/r1/v1/messages", headers={"x-api-key": "s1",
                                                                             "anthropic-version": "2023-06-01"})

    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                    "message": "method OPTIONS not allowed on '/v1/messages'"}}
    assert recorder.calls == []


async def test_it_answers_404_for_an_unknown_rollout_on_an_unknown_path(proxy):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=proxy), base_url="http://proxy") as c:
        r = await c.post("/rollouts/nope/v1/embeddings", json=CHAT, headers={"authorization": "Bearer s1"})

    assert r.status_code == 404 and r.json()["error"]["code"] == "rollout_not_found"


async def test_it_answers_an_unknown_path_of_a_finished_rollout_with_404_not_409(client, directory):
    directory.finish("r1")
    r = await client.post("/embeddings", json={"input": "x"})

    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_endpoint"
