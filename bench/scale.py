"""Scale-out, side by side in one run (issue 14): harness throughput through the proxy with 1 against 2 vLLM
replicas of the tiny model, and trainer step time at world size 1 against 2 (gloo data parallel).

    .venv/bin/python bench/scale.py [--steps 3] [--skip-replicas]

Both ratios are "how much faster the scaled-out shape is": replicas2_vs_1 = calls/s with 2 replicas / calls/s with 1,
ws2_vs_1 = s/step at world size 1 / s/step at world size 2. On this 2-core CPU machine the two replicas and the two
ranks share the same cores, so the figures measure the overhead of routing and of data parallelism (and, through the
weight difference printed beside them, that the distributed update is the same update), not a speed-up: on a GPU
host each replica and each rank has its own device. The parts are bench/_scale_replicas.py and bench/_scale_ws.py;
each also runs alone.

The last line is `RESULT replicas2_vs_1=<x> ws2_vs_1=<x>`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _scale_replicas  # noqa: E402
import _scale_ws  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed trainer steps per world size (after a warm-up)")
    parser.add_argument("--skip-replicas", action="store_true",
                        help="only the trainer part (no vLLM needed); replicas2_vs_1 is then printed as nan")
    args = parser.parse_args()

    if args.skip_replicas:
        replicas = {"replicas2_vs_1": float("nan")}
    else:
        replicas = _scale_replicas.measure()
        print(f"replicas: {_scale_replicas.CLIENTS} clients x {_scale_replicas.CALLS_PER_CLIENT} calls of "
              f"{_scale_replicas.MAX_TOKENS} tokens, {_scale_replicas.ROUNDS} rounds: 1 replica "
              f"{replicas['replicas1_cps']} calls/s, 2 replicas {replicas['replicas2_cps']} calls/s; calls per "
              f"replica with 2: {replicas['calls_per_replica']}", flush=True)

    trainer = _scale_ws.measure(args.steps)
    print(f"trainer: world size 1 {trainer['ws1_s']:.3f} s/step, world size 2 {trainer['ws2_s']:.3f} s/step "
          f"({trainer['samples']} samples, {trainer['tokens']} tokens, {trainer['cores']} cores); weights after "
          f"{trainer['steps'] + 1} steps differ by at most {trainer['max_weight_diff']:.2e}")
    print("note: on a CPU box both shapes share the same cores; these ratios are overhead, not speed-up")
    print(f"RESULT replicas2_vs_1={replicas['replicas2_vs_1']:.3f} ws2_vs_1={trainer['ws2_vs_1']:.3f}")


if __name__ == "__main__":
    main()
