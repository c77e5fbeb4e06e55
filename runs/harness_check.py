"""The harness check: one harness run against the scripted engine (or a given engine) behind the recording proxy,
and a verdict on whether its calls would train: recorded, with token ids, merging into samples, scored.

The conformance suite and the app's harness check (runs.check_tasks) both call `check_harness`.
"""
from __future__ import annotations

import asyncio
import secrets
from collections import Counter
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from catalog.datasets import harness_view, hidden_fields
from proxy.app import ADAPTERS, create_app
from proxy.scripted_engine import Policy, ScriptedEngine, ScriptedServer
from proxy.server import ProxyServer
from proxy.types import InMemoryDirectory, InMemoryRecorder, RecordedCall, UpstreamConfig
from runs.harness_source import trainable_calls
from sandbox.executors.base import Attempt, Executor, Outcome
from sandbox.executors.local import LocalExecutor
from sandbox.scoring import score
from trainer.samples import FORK, BuildResult, Decode, build_samples

ROLLOUT_ID = "check"
OK, WARNING, FAIL = "ok", "warning", "fail"
PATHS = {adapter.api: f"/v1/{path}" for path, adapter in ADAPTERS.items()}
"""The endpoint a call of each API was made on (below the rollout's base URL)."""
UNTRAINED_CHARS = 600
"""A prompt segment of a sample preview longer than this keeps only its head and tail."""


@dataclass(frozen=True)
class CheckResult:
    """What one checked harness run recorded and what training would make of it."""

    calls: list[RecordedCall]
    build: BuildResult
    produced: list[list[int]] | None
    """Completion ids of every answer the scripted engine gave (None with an external engine)."""
    outcome: dict[str, Any]
    harness: Outcome
    reward: dict | None
    """sandbox.scoring.ScoreResult.as_dict(), or None without a reward script (or when the harness never ran)."""
    verdict: str
    reasons: list[str] = field(default_factory=list)
    decode: Decode | None = None

    @property
    def trained_tokens(self) -> int:
        return sum(s.num_loss_tokens for s in self.build.samples)

    @property
    def engine_tokens(self) -> int:
        """Completion tokens the engine produced (as recorded when the engine is not the scripted one)."""
        if self.produced is not None:
            return sum(len(ids) for ids in self.produced)
        return sum(len(c.completion_ids) for c in self.calls)

    def foreign_spans(self) -> list[tuple[int, int]]:
        """(sample index, call seq) of every trained span whose tokens are not a completion the engine produced:
        empty when all trained tokens are the engine's own (unknowable without the scripted engine: empty)."""
        if self.produced is None:
            return []
        produced = {tuple(ids) for ids in self.produced}
        return [(i, span.call_seq) for i, sample in enumerate(self.build.samples) for span in sample.spans
                if span.sampled and tuple(sample.token_ids[span.start:span.end]) not in produced]

    def report(self) -> dict[str, Any]:
        """JSON-safe summary: calls, samples (with a decoded preview), outcome, reward, verdict and reasons."""
        return {
            "verdict": self.verdict, "reasons": list(self.reasons),
            "calls": [_call_row(c, self.build.drift.get(c.seq)) for c in self.calls],
            "drift": dict(Counter(self.build.drift.values())),
            "samples": [{"calls": list(s.call_seqs), "tokens": len(s.token_ids), "trained_tokens": s.num_loss_tokens,
                         "build": s.build, "preview": _preview(s, self.decode)} for s in self.build.samples],
            "trained_tokens": self.trained_tokens, "engine_tokens": self.engine_tokens,
            "foreign_spans": [list(span) for span in self.foreign_spans()],
            "outcome": self.outcome, "reward": self.reward,
            "harness": {k: v for k, v in asdict(self.harness).items() if k != "outcome"},
        }


def check_harness(command: list[str], env: dict[str, str], timeout_s: float, task: dict[str, Any], *,
                  workdir: str | Path, hidden: Iterable[str] = (),
                  tokenizer_dir: str | Path | None = None, engine_base_url: str | None = None,
                  model: str = "scripted", reward_source: str | None = None,
                  policy: Policy | None = None, read_only: Iterable[str] = (), executor: Executor | None = None,
                  proxy_host: str = "127.0.0.1", check_id: str = "") -> CheckResult:
    """Run the harness once on `task` and judge it. The harness sees the task without its reward-only fields (the
    defaults and `hidden`, a dataset's own), the reward script the whole task.

    The engine is the scripted one over `tokenizer_dir` (answering with `policy`, FileEditPolicy by default), or
    the engine at `engine_base_url` serving `model` (then `tokenizer_dir`, if given, only proves realigns).
    The reward script, if any, gets `task` and the harness's outcome. `read_only`: the paths the harness declares
    (its resources["read_only"]), shown to it read-only in its sandbox. `executor` runs the harness (a local
    subprocess by default; a Kubernetes Job for a kubernetes harness, whose pod then reaches the proxy on
    `proxy_host` through the advertised address; `check_id` labels the Job). Blocking.
    """
    if tokenizer_dir is None and engine_base_url is None:
        raise ValueError("check_harness needs tokenizer_dir (the scripted engine) or engine_base_url")
    engine = ScriptedEngine(tokenizer_dir, model_name=model, policy=policy) if engine_base_url is None else None
    recorder, directory, secret = InMemoryRecorder(), InMemoryDirectory(), secrets.token_urlsafe(24)
    directory.add(ROLLOUT_ID, secret)
    with ExitStack() as stack:
        base_url = engine_base_url or stack.enter_context(ScriptedServer(engine)).base_url
        app = create_app(directory, recorder, UpstreamConfig(base_url=base_url, served_model=model))
        proxy = stack.enter_context(ProxyServer(app, host=proxy_host))
        attempt = Attempt(command=list(command), env=dict(env), timeout_s=timeout_s,
                          workdir=Path(workdir) / "rollout", task_id="check",
                          task=harness_view(task, hidden_fields(hidden)),
                          rollout_id=ROLLOUT_ID, base_url=proxy.base_url(ROLLOUT_ID), api_key=secret, model=model,
                          read_only=tuple(read_only), run_id=f"check-{check_id}" if check_id else "")
        out = asyncio.run((executor or LocalExecutor()).run(attempt))
    # The proxy has stopped: its lifespan end flushed every record.
    calls = recorder.for_rollout(ROLLOUT_ID)
    decode = engine.tokenizer.decode if engine is not None else _decoder(tokenizer_dir)
    build = build_samples(trainable_calls(calls), decode)
    reward = None
    if reward_source is not None and out.exit_code is not None:
        reward = score(reward_source, task, out.outcome).as_dict()
    verdict, reasons = judge(calls, build, out, reward)
    return CheckResult(calls, build, engine.produced if engine is not None else None, out.outcome, out, reward,
                       verdict, reasons, decode)


def judge(calls: Sequence[RecordedCall], build: BuildResult, out: Outcome, reward: dict | None
          ) -> tuple[str, list[str]]:
    """(verdict, reasons): 'fail' when the run would train on nothing useful, 'warning' when on less than it
    should, 'ok' otherwise; each reason says what happened and what it means for training."""
    fails, warnings = [], []
    if out.error:
        fails.append(f"the harness failed: {out.error}" + (f" (stderr: {out.stderr_tail[-300:].strip()})"
                                                           if out.stderr_tail.strip() else ""))
    if not calls:
        fails.append("no model calls were recorded: the harness never reached the proxy (is its base URL and key "
                     "taken from the {base_url} and {api_key} placeholders or OPENAI_BASE_URL / ANTHROPIC_BASE_URL?)")
    served = [c for c in calls if _served(c)]
    if len(served) < len(calls):
        failed = "; ".join(f"call {c.seq}: {c.error or c.status_code}" for c in calls if not _served(c))
        warnings.append(f"{len(calls) - len(served)} of {len(calls)} calls failed: {failed[:500]}")
    untokened = [c.seq for c in served if not _complete(c)]
    if served and len(untokened) == len(served):
        fails.append("no call came back with token ids: nothing would be trained (is the engine vLLM with "
                     "return_token_ids?)")
    elif untokened:
        warnings.append(f"calls {untokened} came back without complete token ids: they would not be trained")
    trained = sorted(build.drift)
    if len(trained) > 1 and all(build.drift[seq] == FORK for seq in trained[1:]):
        fails.append(f"only forks: none of the {len(trained)} calls extends an earlier one, so every call trains "
                     "as its own sample (the harness rewrites its history between calls)")
    if reward is not None and not reward.get("ok"):
        fails.append(f"the reward script failed: {reward.get('error')}")
    return (FAIL if fails else WARNING if warnings else OK), fails + warnings


def _served(call: RecordedCall) -> bool:
    return call.status_code == 200 and not call.error


def _complete(call: RecordedCall) -> bool:
    """Prompt ids, completion ids and one logprob per completion id: what a merge and the loss need."""
    return bool(call.prompt_ids and call.completion_ids) and len(call.logprobs) == len(call.completion_ids)


def _decoder(tokenizer_dir: str | Path | None) -> Decode | None:
    if tokenizer_dir is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir)).decode


def _call_row(call: RecordedCall, drift: str | None) -> dict[str, Any]:
    request = call.request if isinstance(call.request, dict) else {}
    return {"seq": call.seq, "api": call.api, "path": PATHS.get(call.api), "model": request.get("model"),
            "stream": call.stream, "status": call.status_code, "error": call.error,
            "finish_reason": call.finish_reason, "tools": len(request.get("tools") or ()),
            "prompt_tokens": len(call.prompt_ids), "completion_tokens": len(call.completion_ids),
            "token_ids_complete": _complete(call), "drift": drift, "latency_ms": round(call.latency_ms, 1)}


def _preview(sample, decode: Decode | None) -> list[dict[str, Any]]:
    """The sample as text segments, each marked trained or not; long prompt segments keep head and tail."""
    if decode is None:
        return []
    segments = []
    for span in sample.spans:
        text = decode(list(sample.token_ids[span.start:span.end]))
        if not span.sampled and len(text) > UNTRAINED_CHARS:
            text = f"{text[:UNTRAINED_CHARS // 3]} … {text[-UNTRAINED_CHARS // 2:]}"
        segments.append({"call": span.call_seq, "trained": span.sampled, "text": text})
    return segments

