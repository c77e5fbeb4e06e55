"""A real run through the REST API with the Celery worker's memory sampled: RSS per step, peak, learning signals.

Start the app first (`./lw up`), then:

    .venv/bin/python bench/run_memory.py --url http://127.0.0.1:8000 --token TOKEN \\
        --config '{"steps": 20, "dtype": "bfloat16"}'

It creates a run of the demo (harness `arith-agent`, dataset `arith-word-problems`, reward `arith-exact` unless named), samples
the resident memory of the worker process (`celery ... worker`, the solo pool runs the run in it) every second,
and prints per step: RSS at the step's end, the peak during the step, reward, engine-trainer logprob mismatch,
mean TIS weight and step time. Last line: RESULT rss_step5_gb=.. rss_last_gb=.. growth_frac=.. peak_gb=..
"""
from __future__ import annotations

import argparse
import json
import time
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from common import procs  # noqa: E402

GB = 1024**3


def api(url: str, token: str, path: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(url.rstrip("/") + "/api/v1/" + path, method="POST" if body else "GET",
                                     data=json.dumps(body).encode() if body else None,
                                     headers={"Authorization": f"Token {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def by_name(url: str, token: str, kind: str, name: str) -> int:
    rows = api(url, token, f"{kind}/?page_size=200")
    for row in rows.get("results", rows):
        if row["name"] == name:
            return row["id"]
    raise SystemExit(f"no {kind} named {name!r}: load the demo first (./lw up does)")


def worker_pids() -> list[int]:
    """Celery worker processes of the runs queue (not the engine or harnesses they start, nor the control worker)."""
    return [pid for pid in procs.pids_matching("celery", " worker") if "vllm" not in procs.cmdline(pid)
            and "--beat" not in procs.cmdline(pid)]


def rss_bytes(pids: list[int]) -> int:
    return sum(procs.rss_bytes(pid) for pid in pids)


def metric(url: str, token: str, run_id: int, name: str) -> dict[int, float]:
    rows = api(url, token, f"runs/{run_id}/metrics/?name={name}")
    rows = rows.get("results", rows) if isinstance(rows, dict) else rows
    return {row["step"]: row["value"] for row in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--token", required=True)
    parser.add_argument("--config", default='{"steps": 20, "dtype": "bfloat16"}')
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--harness", default="arith-agent")
    parser.add_argument("--dataset", default="arith-word-problems")
    parser.add_argument("--reward", default="arith-exact")
    parser.add_argument("--run", type=int, help="follow an existing run instead of creating one")
    args = parser.parse_args()
    if args.run:
        run_id = args.run
    else:
        run = api(args.url, args.token, "runs/", {
            "name": f"memory-{int(time.time())}", "model": args.model, "config": json.loads(args.config),
            "harness": by_name(args.url, args.token, "harnesses", args.harness),
            "dataset": by_name(args.url, args.token, "datasets", args.dataset),
            "reward_script": by_name(args.url, args.token, "reward-scripts", args.reward)})
        run_id = run["id"]
    print(f"run {run_id}: sampling the worker's RSS every second", flush=True)
    per_step: dict[int, tuple[float, float]] = {}
    step, peak, status, started = -1, 0, "queued", time.monotonic()
    while status not in ("succeeded", "failed", "cancelled"):
        peak = max(peak, rss_bytes(worker_pids()))
        state = api(args.url, args.token, f"runs/{run_id}/")
        status = state["status"]
        if state["step"] != step:
            now = rss_bytes(worker_pids())
            step = state["step"]
            per_step[step] = (now / GB, max(peak, now) / GB)
            print(f"  {time.monotonic() - started:7.0f} s  step {step:3d}  rss {now / GB:5.2f} GB  "
                  f"peak {max(peak, now) / GB:5.2f} GB  ({status})", flush=True)
            peak = 0
        time.sleep(1)
    print(f"run {run_id} {status}: {state.get('error') or ''}")
    names = ("reward/mean", "train/logprob_mismatch_mean", "train/logprob_mismatch_max", "is/weight_mean",
             "time/step", "time/generate", "time/train", "eval/pass@1")
    values = {name: metric(args.url, args.token, run_id, name) for name in names}
    print("step  rss_gb  peak_gb  " + "  ".join(n.split("/")[-1] for n in names))
    for s in sorted(per_step):
        cells = [f"{values[n].get(s, float('nan')):.4f}" for n in names]
        print(f"{s:4d}  {per_step[s][0]:6.2f}  {per_step[s][1]:7.2f}  " + "  ".join(cells))
    steps = sorted(k for k in per_step if k >= 1)
    base = per_step.get(5, per_step[steps[0]] if steps else (0.0, 0.0))[0]
    last = per_step[steps[-1]][0] if steps else 0.0
    print(f"RESULT rss_step5_gb={base:.2f} rss_last_gb={last:.2f} growth_frac={(last - base) / max(base, 1e-9):.3f} "
          f"peak_gb={max((p for _, p in per_step.values()), default=0.0):.2f} steps={len(steps)} status={status}")


if __name__ == "__main__":
    main()
