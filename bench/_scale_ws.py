"""Trainer step time at world size 1 against 2 (gloo data parallel) on the tiny model, same batch, same machine.

Each world size gets the machine's cores: world size 1 trains with all of them as torch threads, world size 2 runs
two ranks of cores/2 threads each. The first step (allocator and autograd warm-up) is not timed. Both start from
the same weights and take the same batch, so their weights afterwards also show that the update is the same.

On a 2-core CPU box this measures the overhead of data parallelism (gradient all_reduce over loopback, the
broadcast of the batch, two half-width ranks against one full-width process), not a speed-up.

    .venv/bin/python bench/_scale_ws.py [--steps 3]     # prints RESULT ws2_vs_1=<x> last
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SAMPLES = 32  # tasks_per_step 8 x group_size 4, the default step
PROMPT_TOKENS = (64, 192)
COMPLETION_TOKENS = (32, 128)


def batch(vocab: int, seed: int = 0) -> tuple[list, list[float], list[int]]:
    """One step's samples: random prompts (no loss) and completions (loss) of agent-like lengths."""
    from trainer.samples import Sample

    rng = random.Random(seed)
    samples = []
    for i in range(SAMPLES):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(*PROMPT_TOKENS))]
        completion = [rng.randrange(vocab) for _ in range(rng.randint(*COMPLETION_TOKENS))]
        mask = (0,) * len(prompt) + (1,) * len(completion)
        samples.append(Sample(tuple(prompt + completion), mask, tuple(-2.0 * m for m in mask),
                              tuple(0 if m else -1 for m in mask), (), (i,), "single"))
    advantages = [rng.choice([-1.0, 1.0]) * rng.random() for _ in range(SAMPLES)]
    return samples, advantages, [i // 4 for i in range(SAMPLES)]


def _time_steps(policy, step: tuple, steps: int) -> float:
    policy.train_step(*step)  # warm-up, not timed
    start = time.perf_counter()
    for _ in range(steps):
        policy.train_step(*step)
    return (time.perf_counter() - start) / steps


def measure(steps: int = 3) -> dict:
    """Seconds per trainer step at world size 1 and 2, their ratio, and the largest weight difference after."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.config import TrainerConfig
    from trainer.distributed import DistributedPolicy
    from trainer.models import build_tiny_model
    from trainer.policy import Policy

    cores = os.cpu_count() or 1
    threads_before = torch.get_num_threads()
    config = TrainerConfig(learning_rate=1e-4)
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_tiny_model(Path(tmp) / "tiny", seed=0)
        load = lambda: AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)  # noqa: E731
        step = batch(load().config.vocab_size)
        try:
            torch.set_num_threads(cores)
            one = Policy(load(), config)
            ws1 = _time_steps(one, step, steps)
            torch.set_num_threads(max(1, cores // 2))
            with DistributedPolicy(load(), config, world_size=2) as two:
                ws2 = _time_steps(two, step, steps)
                diff = max((a - b).abs().max().item() for a, b in
                           zip(one.model.state_dict().values(), two.model.state_dict().values()))
        finally:
            torch.set_num_threads(threads_before)
    return {"ws1_s": ws1, "ws2_s": ws2, "ws2_vs_1": ws1 / ws2, "max_weight_diff": diff, "steps": steps,
            "samples": SAMPLES, "tokens": sum(len(s.token_ids) for s in step[0]), "cores": cores}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per world size (after one warm-up)")
    result = measure(parser.parse_args().steps)
    print(f"world size 1: {result['ws1_s']:.3f} s/step; world size 2: {result['ws2_s']:.3f} s/step "
          f"({result['samples']} samples, {result['tokens']} tokens, {result['cores']} cores); "
          f"weights after {result['steps'] + 1} steps differ by at most {result['max_weight_diff']:.2e}")
    print(f"RESULT ws2_vs_1={result['ws2_vs_1']:.3f}")


if __name__ == "__main__":
    main()
