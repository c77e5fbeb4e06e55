"""Typed boundary of the proxy: recorded calls, rollout lookups, recorder protocols and in-memory versions."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

from proxy.sampling import check_sampling

APIS = ("chat", "completions", "responses", "messages")


@dataclass(frozen=True)
class RecordedCall:
    """One model call as the harness made it and as the engine answered it."""

    rollout_id: str
    seq: int
    api: str  # one of APIS
    request: dict  # body the harness sent, verbatim
    response: dict | None  # body returned to the harness (for streams: the assembled final object)
    upstream_request: dict  # chat/completions body sent to the engine
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # sampled-token logprobs, one per completion id
    finish_reason: str | None  # upstream (chat completions) finish reason
    status_code: int
    latency_ms: float
    policy_version: int
    error: str | None
    stream: bool
    started_at: float  # unix time
    upstream_response: dict | None = None  # engine's answer (streams: assembled), with token ids
    sampling_overrides: dict = field(default_factory=dict)  # harness's value of each sampling knob the proxy changed
    choice: int = 0  # the engine choice whose tokens this record holds (see samples_asked)
    constraint: str = ""  # what constrained the engine's decoding (proxy.sampling.constraint_of); '' when free
    replica: int | None = None  # index of the engine replica that answered (None: one engine, no replicas)
    retried: bool = False  # its first replica died under it and another answered (proxy.replicas)


def samples_asked(api: str, request: dict) -> int:
    """How many samples (engine choices) one harness request asks for: `n` on Chat Completions and Completions.

    A call asking for n > 1 is recorded as n RecordedCalls, one per choice, with consecutive seqs reserved when
    it is admitted, each holding the same request, response and prompt ids and its own choice's completion ids
    and logprobs: every choice is a sample the policy produced, drift-classified apart; trainer.samples.build_samples
    says which are trained (those a later call continues, or all when none is).
    """
    if api not in ("chat", "completions"):
        return 1
    n = request.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


@dataclass(frozen=True)
class RolloutInfo:
    """What the proxy needs to know about a rollout to admit a call."""

    rollout_id: str
    secret_hash: str  # proxy.auth.hash_secret(secret)
    finished: bool
    next_seq: int = 0  # seq of the next call (calls already recorded before a proxy restart)
    sampling: dict = field(default_factory=dict)
    """Knobs this rollout samples with over the run's (UpstreamConfig.sampling); {"temperature": 0.0} for a greedy
    evaluation attempt, {} for every other rollout."""
    split: str = "train"
    """'train' or 'val': only train rollouts' calls count in the proxy's generation time and override count,
    so an evaluation running around a training step never shows in that step's metrics."""

    def __post_init__(self) -> None:
        check_sampling(self.sampling, f"rollout {self.rollout_id}'s sampling")


@runtime_checkable
class Recorder(Protocol):
    """Receives every call the proxy served (or failed to serve) and rewards reported by harnesses."""

    async def record(self, call: RecordedCall) -> None: ...

    async def report_reward(self, rollout_id: str, reward: float, detail: dict) -> None: ...


@runtime_checkable
class ResponseFinder(Protocol):
    """Optional on a Recorder: a stored Responses API answer of a rollout, for `previous_response_id`."""

    async def find_response(self, rollout_id: str, response_id: str) -> tuple[dict, dict] | None:
        """(request, response) of the rollout's successful call whose response id is `response_id`, or None."""
        ...


@runtime_checkable
class RolloutDirectory(Protocol):
    """Looks up rollouts by id; called once per request, so it must be cheap."""

    async def get(self, rollout_id: str) -> RolloutInfo | None: ...


@dataclass
class InMemoryRecorder:
    """Recorder keeping calls and rewards in lists (tests, benchmark)."""

    calls: list[RecordedCall] = field(default_factory=list)
    rewards: list[tuple[str, float, dict]] = field(default_factory=list)

    async def record(self, call: RecordedCall) -> None:
        self.calls.append(call)

    async def report_reward(self, rollout_id: str, reward: float, detail: dict) -> None:
        self.rewards.append((rollout_id, reward, detail))

    def for_rollout(self, rollout_id: str) -> list[RecordedCall]:
        return sorted((c for c in self.calls if c.rollout_id == rollout_id), key=lambda c: c.seq)

    async def find_response(self, rollout_id: str, response_id: str) -> tuple[dict, dict] | None:
        for c in self.calls:
            if (c.rollout_id == rollout_id and c.api == "responses" and c.status_code == 200 and c.error is None
                    and isinstance(c.response, dict) and c.response.get("id") == response_id):
                return c.request, c.response
        return None


@dataclass
class InMemoryDirectory:
    """Directory over a dict of RolloutInfo (tests, benchmark)."""

    rollouts: dict[str, RolloutInfo] = field(default_factory=dict)

    def add(self, rollout_id: str, secret: str, next_seq: int = 0, sampling: dict | None = None,
            split: str = "train") -> RolloutInfo:
        from proxy.auth import hash_secret

        info = RolloutInfo(rollout_id, hash_secret(secret), finished=False, next_seq=next_seq,
                           sampling=dict(sampling or {}), split=split)
        self.rollouts[rollout_id] = info
        return info

    def finish(self, rollout_id: str) -> None:
        self.rollouts[rollout_id] = replace(self.rollouts[rollout_id], finished=True)

    async def get(self, rollout_id: str) -> RolloutInfo | None:
        return self.rollouts.get(rollout_id)


class CachedDirectory:
    """Wraps a directory with a short per-rollout cache: a finish is seen within `ttl_s`."""

    def __init__(self, inner: RolloutDirectory, ttl_s: float = 1.0) -> None:
        self._inner = inner
        self._ttl_s = ttl_s
        self._cache: dict[str, tuple[float, RolloutInfo | None]] = {}

    async def get(self, rollout_id: str) -> RolloutInfo | None:
        now = asyncio.get_running_loop().time()
        hit = self._cache.get(rollout_id)
        if hit is not None and now - hit[0] < self._ttl_s:
            return hit[1]
        info = await self._inner.get(rollout_id)
        if info is not None:  # unknown ids are not cached: a guessed id must not grow the cache
            self._cache[rollout_id] = (now, info)
        return info


@dataclass(frozen=True)
class UpstreamConfig:
    """Where the engine is and how to talk to it."""

    base_url: str = "http://127.0.0.1:8000/v1"
    """OpenAI-compatible base URL of the engine, including /v1."""
    replica_urls: tuple[str, ...] = ()
    """Base URLs (each including /v1) of several replicas of the same engine; when set, calls go to them
    (proxy.replicas: a rollout pinned to one, a call cut off by a dying one retried once on another) and
    base_url is not used. Empty: the one engine at base_url."""
    served_model: str = "model"
    """Model name the engine serves; every harness model name maps to it."""
    api_key: str | None = None
    """Bearer key for the engine, if it wants one."""
    connect_timeout_s: float = 5.0
    """Seconds to open a connection to the engine."""
    read_timeout_s: float = 600.0
    """Seconds to wait for the next bytes of an answer (a long generation without streaming)."""
    write_timeout_s: float = 30.0
    """Seconds to send a request body."""
    pool_timeout_s: float = 30.0
    """Seconds to wait for a free connection from the pool."""
    max_connections: int = 512
    """Connections to the engine at most, over all pool shards."""
    pool_shards: int = 64
    """Connection pools side by side (httpcore's per-request cost grows with the square of one pool's size: at 64
    calls in flight, 16 shards had it check 43 connections per request, 64 shards 5)."""
    stream: bool = True
    """Stream from the engine when the harness streams; False asks for whole answers and re-streams them."""
    stream_with_tools: bool = False
    """Stream from the engine also for calls offering tools (vLLM's streaming tool parsers can drop token ids)."""
    sampling: dict | None = None
    """The run's sampling ({"temperature": 0.7, ...}) on every engine call, other knobs neutral; None: the harness's.
    A rollout's own knobs (RolloutInfo.sampling: a greedy evaluation attempt's temperature 0) go over it."""

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"UpstreamConfig.base_url must be an http(s) URL, got {self.base_url!r}")
        object.__setattr__(self, "replica_urls", tuple(self.replica_urls))
        for url in self.replica_urls:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ValueError(f"UpstreamConfig.replica_urls must hold http(s) URLs, got {url!r}")
        if self.pool_shards < 1 or self.max_connections < self.pool_shards:
            raise ValueError("UpstreamConfig needs pool_shards >= 1 and max_connections >= pool_shards")
        if min(self.connect_timeout_s, self.read_timeout_s, self.write_timeout_s, self.pool_timeout_s) <= 0:
            raise ValueError("UpstreamConfig timeouts must be positive seconds")
        if self.sampling is not None:
            check_sampling(self.sampling)


JSON = dict[str, Any]
