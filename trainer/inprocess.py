"""In-process stand-ins for tests and benchmarks: a tiny random Qwen2, a torch sampling engine, a harness source."""
from __future__ import annotations

import asyncio
import copy
import random
import time
from dataclasses import dataclass
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
    """Samples from its own copy of the policy, one call at a time (the one device); implements `Engine`."""

    def __init__(self, model: nn.Module, temperature: float = 1.0, seed: int = 0):
        self.model = copy.deepcopy(model).eval()
        self.temperature = temperature
        self.busy_seconds = 0.0
        self._version = 0
        self._generator = torch.Generator().manual_seed(seed)
        self._device = asyncio.Lock()
        self._open = asyncio.Event()
        self._open.set()
        self._in_flight = 0
        self._drained = asyncio.Event()
        self._drained.set()

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = ()
                       ) -> Generation:
        await self._open.wait()  # held while paused, like the proxy's backpressure
        self._in_flight += 1
        self._drained.clear()
        try:
            async with self._device:
                start = time.perf_counter()
                out = await asyncio.to_thread(self._sample, list(prompt_ids), max_new_tokens, set(stop_ids))
                self.busy_seconds += time.perf_counter() - start
            return out
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._drained.set()

    @torch.no_grad()
    def _sample(self, prompt: list[int], max_new_tokens: int, stop: set[int]) -> Generation:
        ids, cache, completion, logprobs = torch.tensor([prompt]), None, [], []
        for _ in range(max_new_tokens):
            out = self.model(input_ids=ids, cache=cache, use_cache=True)
            cache = out.cache
            logp = torch.log_softmax(out.logits[0, -1].float() / self.temperature, -1)  # (V,)
            token = int(torch.multinomial(logp.exp(), 1, generator=self._generator))
            completion.append(token)
            logprobs.append(float(logp[token]))
            if token in stop:
                return Generation(tuple(completion), tuple(logprobs), "stop", self._version)
            ids = torch.tensor([[token]])
        return Generation(tuple(completion), tuple(logprobs), "length", self._version)

    async def pause(self) -> None:
        self._open.clear()
        await self._drained.wait()

    async def update_weights(self, model: nn.Module, version: int) -> None:
        async with self._device:
            start = time.perf_counter()
            self.model.load_state_dict(model.state_dict())
            self.busy_seconds += time.perf_counter() - start
        self._version = version

    async def resume(self) -> None:
        self._open.set()


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
