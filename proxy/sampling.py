"""The run's sampling parameters, put on every engine request whatever the harness asked for.

The trainer scores each sampled token under the distribution the run configured (temperature, top-k), so
the engine must sample from exactly that: a harness's own temperature, penalties or token masks would make
the recorded logprobs belong to a different distribution. vLLM fills every knob a request leaves out from
the model's generation_config, so all of them are set explicitly, not only those the harness sent.
"""
from __future__ import annotations

PINNED: dict[str, float | int] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
}
"""Knobs that reshape the next-token distribution, at their neutral values; the run's `sampling` sets some."""

REMOVED = ("logit_bias", "allowed_token_ids", "bad_words", "min_tokens", "use_beam_search", "watermarking")
"""Knobs that bias or mask tokens (min_tokens masks the end token), or replace sampling: dropped.

Kept on purpose: `seed` (a sample is still a sample), `stop`, `max_tokens`, `n`, and structured outputs
(`response_format`, tool_choice "required"), which harnesses need to work at all: a call under one is recorded with
its `constraint` (constraint_of) and its tokens are not trained (trainer.samples), since the engine forced them.
"""

GUIDED = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
"""vLLM's own structured-output fields (new and old names): any value constrains decoding."""


def constraint_of(body: dict) -> str:
    """'' when the engine samples this chat/completions body freely; else what constrains its decoding (a grammar
    masks tokens, so the sampled ids are not the policy's samples): 'response_format json_schema', 'tool_choice
    required', 'tool_choice named', 'guided_json', ..."""
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        return f"response_format {fmt.get('type')}"
    choice = body.get("tool_choice")
    if choice == "required" and body.get("tools"):
        return "tool_choice required"
    if isinstance(choice, dict) and body.get("tools"):
        return "tool_choice named"
    for key in GUIDED:
        if _changes_sampling(body.get(key)):
            return key
    return ""

GREEDY: dict[str, float] = {"temperature": 0.0}
"""A greedy evaluation attempt's knobs over the run's: vLLM takes temperature 0 as argmax (top_k, top_p and
min_p then do nothing) and still returns the chosen tokens' logprobs; it refuses n > 1 with it."""


def check_sampling(sampling: dict, what: str = "UpstreamConfig.sampling") -> None:
    """Raise ValueError unless `sampling` maps names from PINNED to numbers; `what` names it in the message."""
    for key, value in sampling.items():
        if key not in PINNED:
            raise ValueError(f"{what} has unknown key {key!r}; valid: {', '.join(PINNED)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{what}[{key!r}] must be a number, got {type(value).__name__}")


def rollout_sampling(run: dict | None, rollout: dict) -> dict | None:
    """The sampling enforced on one rollout's calls: its own knobs over the run's; None leaves the harness's."""
    if not rollout:
        return run
    return {**(run or {}), **rollout}


def _same(key: str, asked: object, value: object) -> bool:
    if key == "top_k" and isinstance(asked, int) and isinstance(value, int):
        return max(asked, 0) == max(value, 0)  # 0 and -1 both mean "all tokens"
    return asked == value


def _changes_sampling(value: object) -> bool:
    return value not in (None, False, 0, {}, [], "")


def enforce_sampling(body: dict, sampling: dict) -> tuple[dict, dict]:
    """The engine request with the run's sampling, and what the harness asked for that the proxy changed.

    The second value maps each changed or removed name to the harness's value; a knob the harness did not
    send, or sent with the value the engine gets, is not in it.
    """
    out = {k: v for k, v in body.items() if k not in REMOVED}
    overrides = {k: body[k] for k in REMOVED if _changes_sampling(body.get(k))}
    for key, value in {**PINNED, **sampling}.items():
        asked = body.get(key)
        if asked is not None and not _same(key, asked, value):
            overrides[key] = asked
        out[key] = value
    return out, overrides
