"""Benchmark: the same workload trained to N steps in sync and in collocated async mode, side by side."""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from tests.trainer.inprocess import SimulatedHarness, TorchEngine, tiny_qwen2
from trainer.config import TrainerConfig
from trainer.policy import Policy
from trainer.scheduler import run

VOCAB = 256


def reward(task, calls):
    tokens = [t for c in calls for t in c.completion_ids]
    return sum(t % 4 == task % 4 for t in tokens) / max(len(tokens), 1)


async def train(mode: str, args, tool_latency: float) -> dict[str, float]:
    """Run `args.steps` steps from the same seed; return wall time and the device-busy fraction."""
    config = TrainerConfig(steps=args.steps, tasks_per_step=args.tasks, group_size=args.group, learning_rate=1e-3,
                           temperature=1.0, mode=mode, max_staleness=args.staleness, seed=0)
    model = tiny_qwen2(vocab_size=VOCAB, hidden_size=args.hidden, layers=args.layers, seed=0)
    engine = TorchEngine(model, temperature=1.0, seed=0)
    source = SimulatedHarness(engine, reward, calls=args.calls, max_new_tokens=args.tokens,
                              tool_latency=tool_latency, tasks=16, seed=0)
    start = time.perf_counter()
    reports = await run(Policy(model, config), engine, source)
    wall = time.perf_counter() - start
    device = [r.metrics["time/generate"] + r.metrics["time/train"] + r.metrics["time/sync"] for r in reports]
    busy = sum(device)
    split = {k: sum(r.metrics[f"time/{k}"] for r in reports) for k in ("generate", "train", "sync", "idle")}
    staleness = max(r.metrics["staleness/max"] for r in reports)
    print(f"{mode:5s}: wall {wall:6.2f} s  busy {min(busy / wall, 1.0):.2f}  split "
          + " ".join(f"{k}={v:.2f}s" for k, v in split.items())
          + f"  max staleness {staleness}  reward {reports[0].metrics['reward/mean']:.3f}"
          f" -> {reports[-1].metrics['reward/mean']:.3f}")
    return {"wall": wall, "busy": min(busy / wall, 1.0), "device_per_step": sum(device[1:]) / max(len(device) - 1, 1)}


async def calibrate(args) -> float:
    """Device time of one step (generation + training + sync, no harness latency), the warm-up step left out."""
    probe = argparse.Namespace(**{**vars(args), "steps": 3})
    return (await train("sync", probe, tool_latency=0.0))["device_per_step"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--tasks", type=int, default=4, help="groups per step")
    parser.add_argument("--group", type=int, default=4, help="attempts per group")
    parser.add_argument("--calls", type=int, default=3, help="model calls per rollout")
    parser.add_argument("--tokens", type=int, default=16, help="max new tokens per call")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--staleness", type=int, default=3, help="async max_staleness")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    device_step = asyncio.run(calibrate(args))
    # The harness's tool time over one rollout equals one step of device work (generation + training).
    tool_latency = device_step / (args.calls)
    print(f"device time per step {device_step:.2f} s -> tool latency {tool_latency:.2f} s per tool call "
          f"({args.calls} per rollout)")
    sync = asyncio.run(train("sync", args, tool_latency))
    async_ = asyncio.run(train("async", args, tool_latency))
    print(f"RESULT speedup={sync['wall'] / async_['wall']:.2f} async_busy={async_['busy']:.2f} "
          f"sync_busy={sync['busy']:.2f}")


if __name__ == "__main__":
    main()
