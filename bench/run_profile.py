"""Benchmark: where a demo run's CPU time goes, phase by phase, and its engine's speed inside the run against alone.

    flock /tmp/lw-heavy.lock .venv/bin/python bench/run_profile.py            # the demo's evaluation, one step
    .venv/bin/python bench/run_profile.py --eval-tasks 8                       # the smallest run with every part

The run: the demo preset (examples/arith/preset.json) through the product, as bench/step_overhead.py's Product runs
it (a fresh data dir with SQLite and the embedded Redis; a Celery worker subprocess driving vLLM, the recording
proxy, one bubblewrapped harness per attempt and the reward sandbox), `--steps` steps (default 1), evaluated before
the first and after the last as the demo is (`--eval-tasks` val tasks x `--eval-samples` sampled attempts and a
greedy one, `eval_concurrency` = 32 at a time).

While it runs, this process reads /proc every `--interval` s and splits the host's CPU time into parts, per phase of
the run (bench/_cpu_ledger.py says how): the engine, the harnesses, the reward runner, the worker's main thread
(the run's event loop), the proxy's thread, the recorder's ORM thread, the trainer, the worker's other threads,
Redis, this profiler, other processes, idle and steal. Shares are of the host's CPU time in the phase.

The engine inside the run: the completion tokens of the evaluations' recorded calls (ModelCall.completion_ids)
over the evaluations' wall time (eval/seconds): `run_engine_tok_s`; over the time at least one call was in flight:
`run_engine_busy_tok_s`. Alone, after the run, same host, same invocation: bench/cpu_speed.py's engine_speed in the
run's resolved engine dtype at `eval_concurrency` calls of `--bench-tokens` tokens: `bench_engine_tok_s`. The
compute roof: a 1024^3 float32 torch matmul, `gemm_gflops`, and its tokens/s at 2 x params FLOPs a token, `roof_tok_s`.
A harness's start-up CPU is what its processes used before its first call entered the proxy.

Last line: RESULT run_engine_tok_s= bench_engine_tok_s= run_vs_bench= eval_s_per_attempt= step_s= (median
time/step), then the busy figure, the roof, the harnesses' CPU, and each part's share in the evaluations and the steps.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from bench._cpu_ledger import PARTS, Child, Ledger, merged, phase_label, read_snapshot  # noqa: E402
from bench.step_overhead import PRESET, Product  # noqa: E402


# ---- arithmetic ---------------------------------------------------------------------------------------------

def busy_seconds(spans: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) spans: the time at least one of them was open."""
    total, end = 0.0, -math.inf
    for start, stop in sorted(spans):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else math.nan


def roof_tok_s(gflops: float, params: int) -> float:
    """Tokens/s a matmul speed allows at 2 x params FLOPs a token (the weights' multiply-adds)."""
    return gflops * 1e9 / (2 * params)


# ---- reading /proc while the run goes on ------------------------------------------------------------------

class Sampler(threading.Thread):
    """Reads a snapshot every `interval` s into its Ledger, labelled with the newest run's phase, until stopped."""

    def __init__(self, worker_pid: int, interval: float, extra_pids: dict[str, int]):
        super().__init__(name="sampler", daemon=True)
        self.worker_pid, self.interval, self.extra_pids = worker_pid, interval, extra_pids
        self.ledger, self.halt, self.error = Ledger(), threading.Event(), None
        self.known: dict[Child, tuple[str, int | None]] = {}

    def run(self) -> None:
        from django.db import connection

        from runs.models import Run

        try:
            while True:
                row = Run.objects.order_by("-pk").values_list("phase", "status").first() or ("", "queued")
                snap = read_snapshot(self.worker_pid, phase_label(*row), self.known,
                                     {"profiler": os.getpid(), **self.extra_pids})
                if snap is not None:
                    self.ledger.add(snap)
                if self.halt.wait(self.interval):
                    break
        except Exception as exc:  # surfaced by stop(): a profile with a hole in it is no profile
            self.error = exc
        finally:
            connection.close()

    def stop(self) -> Ledger:
        self.halt.set()
        self.join()
        if self.error is not None:
            raise RuntimeError("the sampler failed") from self.error
        return self.ledger


# ---- the run's own figures, the engine alone, the roof ----------------------------------------------------

def run_figures(run_id: int) -> dict:
    """From the run's rows: eval seconds and attempts, completion tokens and in-flight spans of the evaluations'
    calls, time/step, the resolved engine dtype and each rollout's first call's entry time."""
    from django.db.models import Sum

    from common.db import JsonArrayLength
    from runs.models import Metric, ModelCall, Rollout, Run

    metrics = Metric.objects.filter(run_id=run_id)
    val_calls = ModelCall.objects.filter(rollout__run_id=run_id, rollout__split="val")
    first_call: dict[int, float] = {}
    for rollout, end, ms in (ModelCall.objects.filter(rollout__run_id=run_id)
                             .values_list("rollout_id", "created_at", "latency_ms")):
        first_call[rollout] = min(first_call.get(rollout, math.inf), end.timestamp() - ms / 1000)
    return {
        "eval_s": sum(metrics.filter(name="eval/seconds").values_list("value", flat=True)),
        "attempts": Rollout.objects.filter(run_id=run_id, split="val").count(),
        "tokens": val_calls.aggregate(n=Sum(JsonArrayLength("completion_ids")))["n"] or 0,
        "spans": [(end.timestamp() - ms / 1000, end.timestamp())
                  for end, ms in val_calls.values_list("created_at", "latency_ms")],
        "step_s": list(metrics.filter(name="time/step").values_list("value", flat=True)),
        "engine_dtype": Run.objects.get(pk=run_id).host["formats"]["engine_dtype"],
        "first_call": first_call,
    }


def bench_engine_tok_s(folder: Path, cache_dir: Path, dtype: str, concurrency: int, tokens: int) -> float:
    """bench/cpu_speed.py's engine measurement, as it runs it, at one concurrency."""
    from bench import cpu_speed

    args = SimpleNamespace(model=folder, cache_dir=cache_dir, isa="this host", tokens=tokens, concurrency=[concurrency])
    speeds, _ = asyncio.run(cpu_speed.engine_speed(args, dtype))
    return speeds[concurrency]


def gemm_gflops(size: int = 1024, seconds: float = 3.0) -> float:
    """float32 size^3 matmul GFLOP/s on torch's threads, repeated for `seconds` after one warm-up."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    count, began = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - began) < seconds or count < 3:
        a @ b
        count += 1
    return 2 * size ** 3 * count / elapsed / 1e9


def model_params(folder: Path) -> int:
    """Parameters in the model's safetensors files (a tied embedding is stored, and counted, once)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as weights:
            total += sum(math.prod(weights.get_slice(key).get_shape()) for key in weights.keys())
    return total


# ---- report -----------------------------------------------------------------------------------------------

def print_table(by_phase: dict[str, dict[str, float]]) -> None:
    print("\nCPU seconds per phase and part (share of the host's CPU time in the phase)")
    print(f"  {'part':<15}" + "".join(f"{phase:>16}" for phase in by_phase))
    for part in (*PARTS, "host_s", "wall_s"):
        cells = []
        for values in by_phase.values():
            share = "" if part in ("host_s", "wall_s") else f" ({ratio(values[part], values['host_s']):4.0%})"
            cells.append(f"{values[part]:9.1f}{share:>7}")
        print(f"  {part:<15}" + "".join(f"{cell:>16}" for cell in cells))


def profile_run(args, config: dict, data_dir: Path) -> tuple[Ledger, dict]:
    """The run through the product with the sampler reading /proc beside it; its ledger and its own figures."""
    product = Product(data_dir, Path(args.models_dir).resolve())
    try:
        product.setup()
        from django.conf import settings

        from trainer.config import TrainerConfig

        product.start_worker()
        redis_pid = int((data_dir / "redis" / "redis.pid").read_text().strip())
        sampler = Sampler(product.worker.pid, args.interval, {"redis": redis_pid})
        sampler.start()
        try:
            run_id, status = product.run(config)
        finally:
            ledger = sampler.stop()
        if not status.startswith("succeeded"):
            raise SystemExit(f"the run {run_id} ended {status}; see {data_dir / 'worker.log'}")
        return ledger, {**run_figures(run_id), "folder": product.model_folder(),
                        "cache_dir": Path(settings.LIGHTNING_ENGINE_CACHE_DIR),
                        "concurrency": TrainerConfig.from_dict(config).eval_concurrency}
    finally:
        product.stop()


def result_fields(ledger: Ledger, run: dict, bench: float, gflops: float, params: int) -> dict[str, float]:
    by_phase = ledger.seconds()
    startup, whole = ledger.harness_cpu(run["first_call"])
    run_tok_s = ratio(run["tokens"], run["eval_s"])
    fields = {"run_engine_tok_s": run_tok_s, "bench_engine_tok_s": bench, "run_vs_bench": ratio(run_tok_s, bench),
              "eval_s_per_attempt": ratio(run["eval_s"], run["attempts"]),
              "step_s": statistics.median(run["step_s"]) if run["step_s"] else math.nan,
              "run_engine_busy_tok_s": ratio(run["tokens"], busy_seconds(run["spans"])),
              "gemm_gflops": gflops, "roof_tok_s": roof_tok_s(gflops, params),
              "harness_startup_cpu_s": startup, "harness_cpu_s": whole}
    for window in ("eval", "step"):
        total = merged(by_phase, window)
        fields.update({f"{window}_share_{part}": ratio(total.get(part, 0.0), total.get("host_s", 0.0))
                       for part in PARTS})
    return fields


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    demo = PRESET["config"]
    parser.add_argument("--steps", type=int, default=1, help="training steps (the demo has 15; one is profiled)")
    parser.add_argument("--eval-tasks", type=int, default=demo["eval_tasks"], help="val tasks per evaluation")
    parser.add_argument("--eval-samples", type=int, default=demo["eval_samples"], help="sampled attempts per task")
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between two reads of /proc")
    parser.add_argument("--bench-tokens", type=int, default=100, help="tokens a call when the engine runs alone")
    parser.add_argument("--config", default="{}", help="JSON overrides of the demo TrainerConfig")
    parser.add_argument("--models-dir", default=str(REPO / "data" / "models"),
                        help="model registry (SmolLM2 is imported there once if missing)")
    parser.add_argument("--data-dir", help="fresh data dir for the run (default: a new temporary one)")
    args = parser.parse_args()
    data_dir = Path(args.data_dir or tempfile.mkdtemp(prefix="lw-run-profile-")).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    config = {**demo, "eval_tasks": args.eval_tasks, "eval_samples": args.eval_samples, **json.loads(args.config),
              "steps": args.steps}
    print(f"data dir {data_dir}; config {config}", flush=True)
    ledger, run = profile_run(args, config, data_dir)
    print(f"\nthe engine alone: {run['engine_dtype']}, {run['concurrency']} concurrent calls", flush=True)
    bench = bench_engine_tok_s(run["folder"], run["cache_dir"], run["engine_dtype"], run["concurrency"],
                               args.bench_tokens)
    import torch

    gflops, params = gemm_gflops(), model_params(run["folder"])
    print_table(ledger.seconds())
    print(f"\nevaluations: {run['attempts']} attempts, {run['tokens']} completion tokens in {run['eval_s']:.0f} s; "
          f"GEMM 1024^3 float32 on {torch.get_num_threads()} threads; {params:,} parameters")
    fields = result_fields(ledger, run, bench, gflops, params)
    print("RESULT " + " ".join(f"{k}={v:.3f}" if abs(v) < 10 else f"{k}={v:.1f}" for k, v in fields.items()))


if __name__ == "__main__":
    main()
