"""The subprocess side of bench/proxy_load.py: harnesses calling through the proxy (no Django), and the fake engine.

    python bench/_proxy_load_harness.py --harness SPEC.json           # say ready, wait for `go`, run, write results
    python bench/_proxy_load_harness.py --serve-upstream --port N     # FakeVLLM (--latency, --chunk-delay)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a script from anywhere

KINDS = ("chat", "chat_stream", "chat", "completions", "chat", "responses", "chat", "chat_stream", "messages", "chat")
"""One harness's cycle of call kinds (each harness starts at its own offset)."""
PAIRED = frozenset({"chat", "chat_stream", "completions"})
"""Kinds also sent straight to the upstream with the same body, for the side-by-side latency."""
API_OF = {"chat": "chat", "chat_stream": "chat", "completions": "completions", "responses": "responses",
          "messages": "messages"}
"""ModelCall.api each kind is recorded under."""
EPISODE_TURNS = 8
"""Turns per conversation: the history grows for this many turns, then a fresh one starts (a bounded context)."""
ANSWER_PREFIX = "Hello! You said: "
"""How FakeVLLM opens every answer; a body without it counts as a failed call."""
SYSTEM = "You are a coding agent. Answer briefly."
MAX_TOKENS = 96


def _text(kind: str, body: dict) -> str:
    """The assistant text of a whole answer in `kind`'s format (KeyError/TypeError/IndexError when malformed)."""
    if kind in ("chat", "chat_stream"):
        return body["choices"][0]["message"]["content"]
    if kind == "completions":
        return body["choices"][0]["text"]
    if kind == "responses":
        return "".join(part["text"] for item in body["output"] if item["type"] == "message"
                       for part in item["content"] if part["type"] == "output_text")
    return "".join(part["text"] for part in body["content"] if part["type"] == "text")


def _request(kind: str, messages: list[dict]) -> tuple[str, dict]:
    """(path under /v1, body) of one call of `kind` carrying the conversation `messages`."""
    if kind in ("chat", "chat_stream"):
        body = {"model": "agent-model", "messages": messages, "max_tokens": MAX_TOKENS}
        if kind == "chat_stream":
            body.update(stream=True, stream_options={"include_usage": True})
        return "/chat/completions", body
    if kind == "completions":
        prompt = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        return "/completions", {"model": "agent-model", "prompt": prompt, "max_tokens": MAX_TOKENS}
    if kind == "responses":
        return "/responses", {"model": "agent-model", "instructions": messages[0]["content"], "store": False,
                              "input": messages[1:], "max_output_tokens": MAX_TOKENS}
    return "/messages", {"model": "claude-agent", "system": messages[0]["content"], "messages": messages[1:],
                         "max_tokens": MAX_TOKENS}


async def _post(session, url: str, headers: dict, kind: str, body: dict) -> tuple[int, str | None, float, str]:
    """(status, assistant text or None, seconds to the whole answer, what went wrong or "") of one call; status 0
    when the connection failed."""
    import aiohttp

    t0 = time.perf_counter()
    try:
        async with session.post(url, json=body, headers=headers) as r:
            if kind != "chat_stream" or r.status != 200:
                data = await r.json(content_type=None)
                if r.status != 200:
                    return r.status, None, time.perf_counter() - t0, json.dumps(data)[:300]
                return r.status, _text(kind, data), time.perf_counter() - t0, ""
            parts, done = [], False
            async for line in r.content:
                line = line.strip()
                if line == b"data: [DONE]":
                    done = True
                elif line.startswith(b"data: "):
                    for choice in json.loads(line[6:])["choices"]:
                        parts.append(choice["delta"].get("content") or "")
            return r.status, "".join(parts) if done else None, time.perf_counter() - t0, "" if done else "no [DONE]"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError, IndexError) as exc:
        return 0, None, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}"[:300]


async def _harness(spec: dict, h: dict, out: list[dict]) -> None:
    """One rollout: `spec["calls"]` multi-turn calls through the proxy, paired kinds also sent direct."""
    import aiohttp

    proxy_headers = {"authorization": f"Bearer {h['key']}", "x-api-key": h["key"], "anthropic-version": "2023-06-01"}
    rng = random.Random(h["index"])
    timeout = aiohttp.ClientTimeout(total=spec["timeout_s"])
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=4)) as session:
        messages: list[dict] = []
        for turn in range(spec["calls"]):
            if turn % EPISODE_TURNS == 0:
                messages = [{"role": "system", "content": SYSTEM}]
            messages.append({"role": "user", "content": f"step {turn}: look at file {rng.randrange(10_000)}.py"})
            kind = KINDS[(turn + h["index"]) % len(KINDS)]
            path, body = _request(kind, messages)
            paths = ["proxy", "direct"] if kind in PAIRED else ["proxy"]
            if turn % 2:
                paths.reverse()
            for where in paths:
                if where == "proxy":
                    status, text, seconds, error = await _post(session, h["url"] + path, proxy_headers, kind, body)
                else:
                    direct = {**body, "model": spec["served_model"], "logprobs": True, "return_token_ids": True}
                    status, text, seconds, error = await _post(session, spec["direct"] + path, {}, kind, direct)
                ok = status == 200 and isinstance(text, str) and text.startswith(ANSWER_PREFIX[:10])
                out.append({"h": h["index"], "turn": turn, "kind": kind, "path": where, "status": status, "ok": ok,
                            "ms": seconds * 1000.0, "error": error if not ok else ""})
                if where == "proxy":
                    reply = text if ok else "(no answer)"
            messages.append({"role": "assistant", "content": reply})


def harness_main(spec_path: str) -> None:
    """Entry of one harness subprocess: say ready, wait for `go` on stdin, run its harnesses, write the results."""
    spec = json.loads(Path(spec_path).read_text())
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    out: list[dict] = []

    async def run_all() -> None:
        await asyncio.gather(*(_harness(spec, h, out) for h in spec["harnesses"]))

    asyncio.run(run_all())
    Path(spec["out"]).write_text(json.dumps(out))


def serve_upstream(port: int, latency_s: float, chunk_delay_s: float) -> None:
    """Entry of the fake engine subprocess (the only fake: the LLM upstream)."""
    import uvicorn

    from tests.proxy.fake_upstream import FakeVLLM

    class Forgetful(FakeVLLM):
        """FakeVLLM without its per-request log (tests read it; a 20,000-call load only grows it)."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.requests = _Discard()

    uvicorn.run(Forgetful(latency_s=latency_s, chunk_delay_s=chunk_delay_s, chunk_bytes=8), host="127.0.0.1",
                port=port, log_level="warning", access_log=False, lifespan="off")


class _Discard(list):
    def append(self, item) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    role = parser.add_mutually_exclusive_group(required=True)
    role.add_argument("--harness", metavar="SPEC", help="run the harnesses of this spec file")
    role.add_argument("--serve-upstream", action="store_true", help="serve the fake engine on --port")
    parser.add_argument("--port", type=int)
    parser.add_argument("--latency", type=float, default=0.2, help="fake engine seconds before it answers")
    parser.add_argument("--chunk-delay", type=float, default=0.004, help="fake engine seconds between stream chunks")
    args = parser.parse_args()
    if args.harness:
        harness_main(args.harness)
    elif args.port is None:
        parser.error("--serve-upstream needs --port")
    else:
        serve_upstream(args.port, args.latency, args.chunk_delay)


if __name__ == "__main__":
    main()
