"""The adapter contract, and the OpenAI Chat Completions and Completions adapters (engine-native)."""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from proxy import sse
from proxy.errors import OPENAI, ProxyError, check_field, error_body
from proxy.types import samples_asked

if TYPE_CHECKING:
    from proxy.recording import ResponseLog


class Adapter:
    """Translates one harness request to the engine and the engine's answer back, whole or streamed."""

    api = ""
    kind = "chat"  # engine API used upstream: "chat" | "completions"
    upstream_path = "chat/completions"
    error_format = OPENAI

    def __init__(self, body: dict) -> None:
        if not isinstance(body, dict):
            raise ProxyError(400, "request body must be a JSON object", "invalid_body")
        self.request = body
        self.stream = bool(check_field(body, "stream", bool))
        self.model = check_field(body, "model", str, required=True)
        self.validate()

    def validate(self) -> None:
        """Check the fields this adapter acts on; raise ProxyError(400) naming the field."""

    async def resolve(self, responses: ResponseLog, rollout_id: str) -> None:
        """Fill in what the request refers to in the rollout's earlier answers (Responses `previous_response_id`);
        raise ProxyError(400) when it names none."""

    @property
    def samples(self) -> int:
        """Engine choices this call asks for: it is recorded as that many calls with consecutive seqs."""
        return samples_asked(self.api, self.request)

    @property
    def has_tools(self) -> bool:
        """Whether the engine is offered tools (then the proxy asks for whole answers, see UpstreamConfig)."""
        return bool(self.request.get("tools"))

    def upstream_body(self, served_model: str, upstream_stream: bool) -> dict:
        raise NotImplementedError

    def response(self, answer: dict) -> dict:
        """The harness's answer from the engine's whole answer."""
        raise NotImplementedError

    def events(self, chunks: AsyncIterator[dict]) -> AsyncIterator[bytes]:
        """The harness's SSE stream from the engine's chunks."""
        raise NotImplementedError

    def stream_error(self, status: int, message: str) -> bytes:
        """An error event for a stream that already started."""
        return sse.encode(error_body(self.error_format, status, message))


def _with_engine_fields(body: dict, served_model: str, upstream_stream: bool) -> dict:
    """Ask the engine for token ids and sampled logprobs; map the model; set streaming."""
    out = {**body, "model": served_model, "return_token_ids": True}
    if upstream_stream:
        out["stream"] = True
        out["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    else:
        out.pop("stream", None)
        out.pop("stream_options", None)
    return out


class _EngineNative(Adapter):
    """Chat and Completions: the engine speaks them, so answers pass through minus fields we added.

    With `n` > 1 the engine answers n choices (interleaved by `index` when streaming); they pass through as they
    are, and each choice is recorded as its own call (proxy.recording.per_choice).
    """

    def validate(self) -> None:
        n = check_field(self.request, "n", int)
        if n is not None and n < 1:
            raise ProxyError(400, f"field 'n' must be at least 1, got {n}", "invalid_value")

    def _wants(self) -> tuple[bool, bool, bool]:
        options = self.request.get("stream_options") or {}
        return (
            bool(self.request.get("return_token_ids")),
            self.request.get("logprobs") is not None and self.request.get("logprobs") is not False,
            bool(isinstance(options, dict) and options.get("include_usage")),
        )

    def _clean(self, body: dict, ids: bool, logprobs: bool) -> dict:
        out = {**body, "model": self.model}
        if not ids:
            out.pop("prompt_token_ids", None)
        choices = []
        for choice in body.get("choices") or ():
            choice = dict(choice)
            if not ids:
                choice.pop("token_ids", None)
                choice.pop("prompt_token_ids", None)
            if not logprobs:
                choice["logprobs"] = None
            choices.append(choice)
        out["choices"] = choices
        return out

    def response(self, answer: dict) -> dict:
        ids, logprobs, _ = self._wants()
        return self._clean(answer, ids, logprobs)

    async def events(self, chunks: AsyncIterator[dict]) -> AsyncIterator[bytes]:
        ids, logprobs, usage = self._wants()
        async for chunk in chunks:
            if not chunk.get("choices") and not usage:
                continue  # the usage chunk we asked for on the harness's behalf
            out = self._clean(chunk, ids, logprobs)
            if not usage:
                out.pop("usage", None)
            yield sse.encode(out)
        yield sse.DONE


class ChatAdapter(_EngineNative):
    api = "chat"

    def validate(self) -> None:
        messages = check_field(self.request, "messages", list, required=True)
        if not messages:
            raise ProxyError(400, "field 'messages' must not be empty", "invalid_value")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ProxyError(400, f"messages[{i}] must be an object with a string 'role'", "invalid_type")
        check_field(self.request, "tools", list)
        check_field(self.request, "max_tokens", int)
        check_field(self.request, "max_completion_tokens", int)
        check_field(self.request, "stream_options", dict)
        super().validate()

    def upstream_body(self, served_model: str, upstream_stream: bool) -> dict:
        body = _with_engine_fields(self.request, served_model, upstream_stream)
        body["logprobs"] = True
        return body


class CompletionsAdapter(_EngineNative):
    api = "completions"
    kind = "completions"
    upstream_path = "completions"

    def validate(self) -> None:
        prompt = check_field(self.request, "prompt", (str, list), required=True)
        if isinstance(prompt, list) and not all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in prompt):
            raise ProxyError(400, "field 'prompt' must be a string, a list of strings or token ids", "invalid_type")
        check_field(self.request, "max_tokens", int)
        check_field(self.request, "logprobs", int)
        check_field(self.request, "stream_options", dict)
        super().validate()

    def upstream_body(self, served_model: str, upstream_stream: bool) -> dict:
        body = _with_engine_fields(self.request, served_model, upstream_stream)
        body["logprobs"] = max(int(self.request.get("logprobs") or 0), 0)  # 0: the sampled token's logprob only
        return body
