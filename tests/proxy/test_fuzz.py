"""Hostile bodies on all four model APIs: wrong types, huge strings, deep nesting, broken encodings.

Each gets a 200 or a 4xx in its API's error format, records nothing unless it was answered, and leaves no slot
taken in the gate. test_robustness.py covers arbitrary small JSON objects; this file takes valid bodies and
breaks one thing in each, at sizes and depths that reach the parser's and the body limit's edges.
"""
from __future__ import annotations

import gzip
import json

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from proxy.request_json import MAX_JSON_DEPTH

VALID = {
    "/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
    "/completions": {"model": "m", "prompt": "hi", "max_tokens": 8},
    "/responses": {"model": "m", "input": "hi", "max_output_tokens": 8},
    "/messages": {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
}
ENDPOINTS = list(VALID)
LIMIT = 64 * 1024  # the `proxy` fixture's max_body_bytes
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

any_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
              st.text(max_size=20)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=10)


def nested(depth: int, leaf: object = "x") -> str:
    """JSON text of `leaf` inside `depth` alternating arrays and objects."""
    opens = "".join('[' if i % 2 else '{"k":' for i in range(depth))
    closes = "".join(']' if i % 2 else '}' for i in reversed(range(depth)))
    return opens + json.dumps(leaf) + closes


def assert_answered(r, endpoint: str, statuses: tuple[int, ...] = (200, 400, 413)) -> None:
    """A status from `statuses`, and any error in the endpoint's own format with a message."""
    assert r.status_code in statuses, (r.status_code, r.text[:300])
    if r.status_code == 200:
        return
    body = r.json()
    if endpoint == "/messages":
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["message"]
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]
        assert body["error"]["type"] == "invalid_request_error"


async def post(client, endpoint: str, content: bytes, **headers: str):
    return await client.post(endpoint, content=content, headers={"content-type": "application/json", **headers})


def settled(proxy, recorder, before: int, r) -> None:
    """Nothing recorded for a refused body, one 200 record for an answered one; no call left in the gate."""
    assert len(recorder.calls) == before + (r.status_code == 200)
    assert proxy.gate.in_flight == 0


@FUZZ
@given(endpoint=st.sampled_from(ENDPOINTS), data=st.data(), value=any_json)
async def test_a_field_of_the_wrong_type_is_answered_or_refused_in_format(client, proxy, recorder, endpoint,
                                                                          data, value):
    body = dict(VALID[endpoint])
    body[data.draw(st.sampled_from([*body, "stream", "tools"]))] = value  # fields the proxy reads; the rest pass
    before = len(recorder.calls)

    r = await post(client, endpoint, json.dumps(body).encode())

    assert_answered(r, endpoint, (200, 400))
    settled(proxy, recorder, before, r)


@FUZZ
@given(endpoint=st.sampled_from(ENDPOINTS), size=st.integers(0, 2 * LIMIT),
       char=st.sampled_from(["a", "é", "\U0001f600", "\x00", '"', "\\"]))
async def test_a_huge_string_is_answered_or_refused_with_413(client, proxy, recorder, endpoint, size, char):
    body = dict(VALID[endpoint])
    text = char * (size // len(char.encode()))
    body["model" if size % 2 else next(k for k in ("messages", "prompt", "input") if k in body)] = (
        text if size % 2 or endpoint in ("/completions", "/responses") else [{"role": "user", "content": text}])
    content = json.dumps(body).encode()
    before = len(recorder.calls)

    r = await post(client, endpoint, content)

    assert_answered(r, endpoint)
    assert (r.status_code == 413) == (len(content) > LIMIT)
    settled(proxy, recorder, before, r)


@FUZZ
@given(endpoint=st.sampled_from(ENDPOINTS), depth=st.integers(1, 20_000))
async def test_deep_nesting_is_answered_or_refused_never_a_500(client, proxy, recorder, endpoint, depth):
    body = json.dumps(VALID[endpoint])
    content = (body[:-1] + ', "metadata": ' + nested(depth) + "}").encode()
    before = len(recorder.calls)

    r = await post(client, endpoint, content)

    assert_answered(r, endpoint)
    assert r.status_code == (413 if len(content) > LIMIT else 400 if depth + 1 > MAX_JSON_DEPTH else 200)
    settled(proxy, recorder, before, r)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("depth, status", [(MAX_JSON_DEPTH - 1, 200), (MAX_JSON_DEPTH, 400)])
async def test_nesting_is_limited_to_max_json_depth_counting_the_body(client, endpoint, depth, status):
    body = json.dumps(VALID[endpoint])

    r = await post(client, endpoint, (body[:-1] + ', "metadata": ' + nested(depth) + "}").encode())

    assert r.status_code == status


@pytest.mark.parametrize("endpoint", ENDPOINTS)
async def test_nesting_past_the_parsers_limit_is_a_400_that_says_so(client, recorder, endpoint):
    r = await post(client, endpoint, nested(5000).encode())

    assert_answered(r, endpoint, (400,))
    assert "nested too deeply (over 128 levels)" in json.dumps(r.json()) and recorder.calls == []


@FUZZ
@given(endpoint=st.sampled_from(ENDPOINTS), junk=st.binary(min_size=1, max_size=8), at=st.integers(0, 10_000))
async def test_invalid_utf8_anywhere_in_the_body_is_refused_or_answered(client, proxy, recorder, endpoint, junk, at):
    content = json.dumps(VALID[endpoint]).encode()
    at %= len(content)
    before = len(recorder.calls)

    r = await post(client, endpoint, content[:at] + junk + content[at:])

    assert_answered(r, endpoint, (200, 400))
    settled(proxy, recorder, before, r)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("raw, why", [
    (b'"\xff\xfe"', "not valid JSON"),
    (b'"\\ud800 alone"', "lone UTF-16 surrogate"),
    (b'"\\udfff"', "lone UTF-16 surrogate"),
    (b"NaN", "not valid JSON"),
    (b"-Infinity", "not valid JSON"),
    (b"1e999", "not valid JSON"),
    (b"1" + b"0" * 5000, "not valid JSON"),
])
async def test_values_no_engine_or_database_could_take_are_refused_with_400(client, fake, recorder, endpoint, raw,
                                                                             why):
    body = json.dumps({**VALID[endpoint], "metadata": "HOLE"}).encode().replace(b'"HOLE"', raw)

    r = await post(client, endpoint, body)

    assert_answered(r, endpoint, (400,))
    assert why in json.dumps(r.json()) and recorder.calls == [] and fake.requests == []


@pytest.mark.parametrize("endpoint", ENDPOINTS)
async def test_a_valid_surrogate_pair_is_not_mistaken_for_a_lone_one(client, recorder, endpoint):
    body = json.dumps({**VALID[endpoint], "metadata": "\U0001f600"}).encode()  # json writes \ud83d\ude00

    r = await post(client, endpoint, body)

    assert r.status_code == 200 and len(recorder.calls) == 1


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "zstd"])
async def test_a_compressed_body_is_refused_with_415_and_never_inflated(client, fake, recorder, endpoint, encoding):
    bomb = gzip.compress(b" " * (16 * 1024 * 1024))  # 16 KiB on the wire, 16 MiB inflated

    r = await post(client, endpoint, bomb, **{"content-encoding": encoding})

    assert_answered(r, endpoint, (415,))
    assert f"Content-Encoding '{encoding}'" in json.dumps(r.json()) and recorder.calls == [] and fake.requests == []


@pytest.mark.parametrize("endpoint", ENDPOINTS)
async def test_identity_encoding_is_accepted(client, recorder, endpoint):
    r = await post(client, endpoint, json.dumps(VALID[endpoint]).encode(), **{"content-encoding": "identity"})

    assert r.status_code == 200 and len(recorder.calls) == 1
