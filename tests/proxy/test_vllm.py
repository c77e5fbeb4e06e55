"""The proxy in front of a real vLLM (engine venv, tiny model): recorded ids are the template's and decode to the text."""
from __future__ import annotations

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from proxy.app import create_app
from proxy.sampling import PINNED
from proxy.types import InMemoryDirectory, InMemoryRecorder, UpstreamConfig
from trainer.engine import EngineConfig, VLLMServer, default_engine_venv

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not (default_engine_venv() / "bin" / "python").exists(),
                       reason=f"no engine venv at {default_engine_venv()}: run scripts/setup-engine"),
]
MESSAGES = [{"role": "system", "content": "You are a calculator."},
            {"role": "user", "content": "What is 12 + 34? Answer with CALC: then the numbers."}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from trainer.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", seed=0)


@pytest.fixture(scope="module")
def engine(tiny, tmp_path_factory):
    config = EngineConfig(model_path=str(tiny), served_model_name="tiny", max_model_len=1024, kv_cache_gb=0.25,
                          dtype="float32")
    server = VLLMServer(config, log_path=tmp_path_factory.mktemp("engine") / "engine.log").start(timeout=600)
    yield server
    server.stop()


@pytest.fixture
def sampling() -> dict | None:
    return None


@pytest.fixture
async def proxied(engine, sampling):
    directory, recorder = InMemoryDirectory(), InMemoryRecorder()
    directory.add("r1", "s1")
    config = UpstreamConfig(base_url=engine.base_url + "/v1", served_model="tiny", sampling=sampling)
    app = create_app(directory, recorder, config)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
    yield http, recorder
    await http.aclose()
    await app.aclose()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_it_records_the_templates_prompt_ids_and_ids_that_decode_to_the_text(proxied, tiny, stream):
    http, recorder = proxied
    sdk = openai.AsyncOpenAI(base_url="http://proxy/rollouts/r1/v1", api_key="s1", http_client=http, max_retries=0)
    tokenizer = AutoTokenizer.from_pretrained(tiny)

    if stream:
        chunks = [c async for c in await sdk.chat.completions.create(
            model="gpt-4o", messages=MESSAGES, max_tokens=24, temperature=0.0, stream=True)]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        reply = await sdk.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=24, temperature=0.0)
        text = reply.choices[0].message.content

    [call] = recorder.calls
    assert call.status_code == 200 and call.stream is stream
    assert call.prompt_ids == tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                            return_dict=False)
    assert call.completion_ids and len(call.logprobs) == len(call.completion_ids)
    assert all(lp <= 0.0 for lp in call.logprobs)
    assert tokenizer.decode(call.completion_ids, skip_special_tokens=True) == text
    assert call.finish_reason in ("stop", "length")


async def test_it_records_template_ids_for_a_translated_anthropic_stream(proxied, tiny):
    http, recorder = proxied
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    body = {"model": "claude-sonnet-4-5", "max_tokens": 16, "temperature": 0.0, "stream": True,
            "system": MESSAGES[0]["content"], "messages": [MESSAGES[1]]}

    r = await http.post("http://proxy/rollouts/r1/v1/messages", json=body, headers={"x-api-key": "s1"})

    assert r.status_code == 200 and "event: message_stop" in r.text
    [call] = recorder.calls
    assert call.prompt_ids == tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                            return_dict=False)
    text = "".join(block["text"] for block in call.response["content"] if block["type"] == "text")
    assert tokenizer.decode(call.completion_ids, skip_special_tokens=True) == text
    assert call.response["usage"]["output_tokens"] == len(call.completion_ids)


async def test_it_records_template_ids_for_a_responses_call_with_tools(proxied, tiny):
    http, recorder = proxied
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    tool = {"type": "function", "name": "bash", "description": "run a command",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}
    sdk = openai.AsyncOpenAI(base_url="http://proxy/rollouts/r1/v1", api_key="s1", http_client=http, max_retries=0)

    async with sdk.responses.stream(model="gpt-5-codex", instructions=MESSAGES[0]["content"], input=MESSAGES[1]["content"],
                                    tools=[tool], max_output_tokens=16, temperature=0.0) as stream:
        final = await stream.get_final_response()

    [call] = recorder.calls
    assert call.status_code == 200 and call.error is None
    chat_tool = {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")}}
    assert call.prompt_ids == tokenizer.apply_chat_template(MESSAGES, tools=[chat_tool], add_generation_prompt=True,
                                                            tokenize=True, return_dict=False)
    assert call.response["id"] == final.id and len(call.logprobs) == len(call.completion_ids)


async def test_it_counts_tokens_with_the_engines_tokenizer_and_records_nothing(proxied, tiny):
    """Anthropic count_tokens through vLLM's /tokenize: the template's own count, equal to the call's input_tokens."""
    http, recorder = proxied
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    schema = {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}
    tool = {"name": "bash", "description": "run a command", "input_schema": schema}
    chat_tool = {"type": "function", "function": {"name": "bash", "description": "run a command", "parameters": schema}}
    prefill = [MESSAGES[1], {"role": "assistant", "content": "CALC:"}]
    headers = {"x-api-key": "s1", "anthropic-version": "2023-06-01"}
    base = {"model": "claude-sonnet-4-5", "system": MESSAGES[0]["content"]}

    async def post(path: str, body: dict) -> dict:  # raw HTTP: this anthropic SDK wants its own httpx fork
        r = await http.post(f"http://proxy/rollouts/r1/v1/{path}", json={**base, **body}, headers=headers)
        assert r.status_code == 200, r.text
        return r.json()

    counted = (await post("messages/count_tokens", {"messages": [MESSAGES[1]], "tools": [tool]}))["input_tokens"]
    continued = (await post("messages/count_tokens", {"messages": prefill}))["input_tokens"]
    message = await post("messages", {"messages": [MESSAGES[1]], "tools": [tool], "max_tokens": 8,
                                      "temperature": 0.0})

    rendered = tokenizer.apply_chat_template(MESSAGES, tools=[chat_tool], add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    prefilled = tokenizer.apply_chat_template([MESSAGES[0], *prefill], continue_final_message=True,
                                              add_generation_prompt=False, tokenize=True, return_dict=False)
    assert counted == len(rendered) == message["usage"]["input_tokens"]
    assert continued == len(prefilled)
    [call] = recorder.calls  # the messages call only: counting is not a model call
    assert call.api == "messages" and call.prompt_ids == rendered


@pytest.mark.parametrize("sampling", [{"temperature": 0.0, "top_p": 1.0, "top_k": -1}])
async def test_it_samples_with_the_runs_parameters_whatever_the_harness_sends(proxied, engine, sampling):
    """The run says greedy: a harness asking for heat, penalties and a bias still gets the greedy answer."""
    http, recorder = proxied
    url, auth = "http://proxy/rollouts/r1/v1/chat/completions", {"authorization": "Bearer s1"}
    plain = await http.post(url, headers=auth, json={"model": "m", "messages": MESSAGES, "max_tokens": 24})
    noisy = await http.post(url, headers=auth, json={
        "model": "m", "messages": MESSAGES, "max_tokens": 24, "temperature": 1.5, "presence_penalty": 1.5,
        "repetition_penalty": 1.3, "min_tokens": 20, "logit_bias": {"0": 50}})
    async with httpx.AsyncClient() as direct:  # the engine itself, greedy with neutral knobs
        greedy = await direct.post(engine.base_url + "/v1/chat/completions", json={
            **PINNED, "temperature": 0.0, "model": "tiny", "messages": MESSAGES, "max_tokens": 24,
            "return_token_ids": True})

    assert (plain.status_code, noisy.status_code, greedy.status_code) == (200, 200, 200)
    first, second = recorder.calls
    assert first.completion_ids == second.completion_ids == greedy.json()["choices"][0]["token_ids"]
    assert first.sampling_overrides == {}
    assert second.sampling_overrides == {"temperature": 1.5, "presence_penalty": 1.5, "repetition_penalty": 1.3,
                                         "min_tokens": 20, "logit_bias": {"0": 50}}
