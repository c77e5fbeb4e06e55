"""In-process stand-ins for tests and benchmarks: a tiny random Qwen2, a torch sampling engine, a harness source."""
from __future__ import annotations

import asyncio
import copy
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM

from trainer.samples import CallRecord
from trainer.scheduler import GroupRequest, RolloutResult


def tiny_qwen2(vocab_size: int = 64, hidden_size: int = 64, layers: int = 2, seed: int = 0) -> Qwen2ForCausalLM:
    """A deterministic randomly initialised Qwen2 over integer tokens (no tokenizer needed)."""
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=True, attention_dropout=0.0)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    return model


@dataclass(frozen=True)
class Generation:
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    policy_version: int


class TorchEngine:
    """Samples from its own copy of the policy; implements `Engine`.

    Like vLLM it batches continuously: a call that arrives while others decode joins the running batch at the
    next token. Generation and weight updates share one device lock.
    """

    def __init__(self, model: nn.Module, temperature: float = 1.0, seed: int = 0, max_batch: int = 64):
        self.model = copy.deepcopy(model).eval()
        self.max_batch = max_batch
        self.busy_seconds = 0.0
        self._batch = _DecodeBatch(self.model, temperature, torch.Generator().manual_seed(seed))
        self._device = asyncio.Lock()
        self._open = asyncio.Event()
        self._open.set()
        self._in_flight = 0
        self._drained = asyncio.Event()
        self._drained.set()
        self._queue: list[_Request] = []
        self._wakeup = asyncio.Event()
        self._worker: asyncio.Task | None = None

    @property
    def version(self) -> int:
        return self._batch.version

    async def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = ()
                       ) -> Generation:
        await self._open.wait()  # held while paused, like the proxy's backpressure
        self._in_flight += 1
        self._drained.clear()
        try:
            future = asyncio.get_running_loop().create_future()
            self._queue.append(_Request(list(prompt_ids), max_new_tokens, frozenset(stop_ids), future))
            self._wakeup.set()
            if self._worker is None or self._worker.done():
                self._worker = asyncio.create_task(self._work())
            return await future
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._drained.set()

    async def _work(self) -> None:
        """One decode step per iteration for every running call, admitting queued calls as they come."""
        while True:
            if not self._queue and not self._batch.rows:
                self._wakeup.clear()
                await self._wakeup.wait()
            room = self.max_batch - len(self._batch.rows)
            admitted, self._queue = self._queue[:room], self._queue[room:]
            async with self._device:
                start = time.perf_counter()
                try:
                    finished = await asyncio.to_thread(self._batch.step, admitted)
                except Exception as exc:  # every running call learns why; the batch starts over
                    finished = [(r, exc) for r in self._batch.rows + admitted]
                    self._batch.clear()
                self.busy_seconds += time.perf_counter() - start
            for request, result in finished:
                if request.future.done():
                    continue  # the caller was cancelled
                if isinstance(result, Exception):
                    request.future.set_exception(result)
                else:
                    request.future.set_result(result)

    async def pause(self) -> None:
        self._open.clear()
        await self._drained.wait()

    async def update_weights(self, model: nn.Module, version: int) -> None:
        async with self._device:
            start = time.perf_counter()
            self.model.load_state_dict(model.state_dict())
            self.busy_seconds += time.perf_counter() - start
        self._batch.version = version

    async def resume(self) -> None:
        self._open.set()


@dataclass
class _Request:
    prompt: list[int]
    max_new_tokens: int
    stop: frozenset[int]
    future: asyncio.Future
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.max_new_tokens or (bool(self.tokens) and self.tokens[-1] in self.stop)


class _DecodeBatch:
    """The running rows of a continuously batched decode: a left-padded KV cache shared by all rows."""

    def __init__(self, model: nn.Module, temperature: float, generator: torch.Generator):
        self.model, self.temperature, self.generator = model, temperature, generator
        self.version = 0
        self.clear()

    def clear(self) -> None:
        self.rows: list[_Request] = []
        self.cache = None
        self.mask = torch.zeros(0, 0, dtype=torch.long)  # (B, T) 1 where the cache holds a real token
        self.next_pos = torch.zeros(0, 1, dtype=torch.long)  # (B, 1)
        self.last = torch.zeros(0, 1, dtype=torch.long)  # (B, 1) sampled, not yet fed

    @torch.no_grad()
    def step(self, admitted: list[_Request]) -> list[tuple[_Request, Generation]]:
        """Decode one token for the running rows, prefill the admitted ones; return the calls that finished."""
        if self.rows:
            self.mask = torch.cat([self.mask, torch.ones_like(self.last)], dim=1)
            out = self.model(input_ids=self.last, attention_mask=self.mask, position_ids=self.next_pos,
                             cache=self.cache, use_cache=True)
            self.cache, self.next_pos = out.cache, self.next_pos + 1
            self.last = self._pick(self.rows, out.logits[:, -1])
        if admitted:
            self._prefill(admitted)
        return self._retire()

    def _pick(self, rows: list[_Request], logits: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(logits.float() / self.temperature, -1)  # (B, V)
        picked = torch.multinomial(logp.exp(), 1, generator=self.generator)  # (B, 1)
        for row, token, lp in zip(rows, picked[:, 0].tolist(), logp.gather(1, picked)[:, 0].tolist()):
            row.tokens.append(token)
            row.logprobs.append(lp)
        return picked

    def _prefill(self, rows: list[_Request]) -> None:
        width = max(len(r.prompt) for r in rows)
        ids = torch.tensor([[0] * (width - len(r.prompt)) + r.prompt for r in rows])  # (Bn, Ln)
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in rows])  # (Bn, Ln)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        last = self._pick(rows, out.logits[:, -1])
        if not self.rows:
            self.rows, self.cache, self.mask, self.next_pos, self.last = rows, out.cache, mask, positions[:, -1:] + 1, last
            return
        pad = max(self.mask.shape[1], width)
        for old, new in zip(self.cache.layers, out.cache.layers):
            old.keys = torch.cat([_left_pad(old.keys, pad), _left_pad(new.keys, pad)])
            old.values = torch.cat([_left_pad(old.values, pad), _left_pad(new.values, pad)])
        self.mask = torch.cat([_left_pad(self.mask, pad), _left_pad(mask, pad)])
        self.next_pos = torch.cat([self.next_pos, positions[:, -1:] + 1])
        self.last = torch.cat([self.last, last])
        self.rows = self.rows + rows

    def _retire(self) -> list[tuple[_Request, Generation]]:
        """Drop finished rows (and cache columns no row needs any more); return their results."""
        finished = [(r, Generation(tuple(r.tokens), tuple(r.logprobs),
                                   "stop" if r.tokens[-1] in r.stop else "length", self.version))
                    for r in self.rows if r.done]
        if not finished:
            return []
        keep = [i for i, r in enumerate(self.rows) if not r.done]
        if not keep:
            self.clear()
            return finished
        index = torch.tensor(keep)
        first = int(self.mask[index].any(0).long().argmax())  # leading columns padded in every kept row
        for layer in self.cache.layers:
            layer.keys = layer.keys[index, :, first:]
            layer.values = layer.values[index, :, first:]
        self.rows = [self.rows[i] for i in keep]
        self.mask, self.next_pos, self.last = self.mask[index, first:], self.next_pos[index], self.last[index]
        return finished


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad dim 2 of a (B, H, T, D) cache tensor, or dim 1 of a (B, T) mask, on the left to `width`."""
    dim = 2 if t.dim() == 4 else 1
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


Reward = Callable[[int, Sequence[CallRecord]], float]
"""(task, the rollout's calls) -> reward."""


class SimulatedHarness:
    """A `RolloutSource` whose harness makes `calls` model calls per rollout with a tool pause between them.

    Prompt of a task: [1, 10 + task]. After each reply the "tool" answers with tokens [2, 3] after
    `tool_latency` seconds (an asyncio sleep: the harness works while the trainer does).
    """

    def __init__(self, engine: TorchEngine, reward: Reward, *, calls: int = 2, max_new_tokens: int = 4,
                 tool_latency: float = 0.0, tasks: int = 8, seed: int = 0):
        self.engine, self.reward = engine, reward
        self.calls, self.max_new_tokens, self.tool_latency, self.tasks = calls, max_new_tokens, tool_latency, tasks
        self._rng = random.Random(seed)
        self._finished: asyncio.Queue[RolloutResult] = asyncio.Queue()
        self._running: dict[int, list[asyncio.Task]] = {}

    async def launch(self, group: GroupRequest) -> None:
        task = self._rng.randrange(self.tasks)
        self._running[group.group_id] = [
            asyncio.create_task(self._rollout(group.group_id, f"g{group.group_id}-a{i}", task))
            for i in range(group.size)]

    async def next_finished(self) -> RolloutResult:
        return await self._finished.get()

    async def cancel(self, group_id: int) -> None:
        for t in self._running.pop(group_id, []):
            t.cancel()

    async def _rollout(self, group_id: int, rollout_id: str, task: int) -> None:
        prompt, calls = [1, 10 + task], []
        for seq in range(self.calls):
            out = await self.engine.generate(prompt, self.max_new_tokens)
            calls.append(CallRecord(seq, tuple(prompt), out.completion_ids, out.logprobs, out.finish_reason,
                                    out.policy_version))
            if seq + 1 < self.calls:
                await asyncio.sleep(self.tool_latency)
                prompt = prompt + list(out.completion_ids) + [2, 3]
        await asyncio.sleep(self.tool_latency)  # the harness's final work (tests, reward) before it reports
        self._finished.put_nowait(RolloutResult(group_id, rollout_id, tuple(calls), self.reward(task, calls)))
