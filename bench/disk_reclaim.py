"""Disk a run leaves (issue 26.2): a real 3-step run on the CPU (tests/runs/test_disk_run.py: vLLM, harness
subprocesses, checkpoints every step), then its deletion; and a run with 32 attempts in flight and injected harness
failures (exits and timeouts), counting the live attempts whose workdir a failure's clean-up took (issue 40.1).

    .venv/bin/python bench/disk_reclaim.py

Prints the run's figures, then `RESULT disk_left_by_succeeded_rollouts_mb=<x> left_after_delete_mb=<y>
succeeded_rollouts=<n> failed_workdirs_kept=<k> run_folder_mb=<z> live_workdirs_lost=<n> live_attempts=<n>
injected_failures=<n>` (run_folder_mb: what the run held before its
deletion: checkpoints, engine weights, failed workdirs). Database and Redis come from the environment as for the
tests.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="disk-reclaim-") as tmp:
        figures = Path(tmp) / "figures.json"
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "tests/runs/test_disk_run.py"], cwd=ROOT,
                              env={**os.environ, "LIGHTNING_BENCH_FIGURES": str(figures)})
        if done.returncode != 0 or not figures.is_file():  # a lost live workdir fails its test too
            print(f"the run failed (pytest exit {done.returncode}): no figures")
            sys.exit(1)
        values = json.loads(figures.read_text())
    print("RESULT " + " ".join(f"{key}={value:.1f}" if isinstance(value, float) else f"{key}={value}"
                               for key, value in (("disk_left_by_succeeded_rollouts_mb",
                                                   values["disk_left_by_succeeded_rollouts_mb"]),
                                                  ("left_after_delete_mb", values["left_after_delete_mb"]),
                                                  ("succeeded_rollouts", values["succeeded_rollouts"]),
                                                  ("failed_workdirs_kept", values["failed_workdirs_kept"]),
                                                  ("run_folder_mb", values["run_folder_mb"]),
                                                  ("live_workdirs_lost", values["live_workdirs_lost"]),
                                                  ("live_attempts", values["live_attempts"]),
                                                  ("injected_failures", values["injected_failures"]))))


if __name__ == "__main__":
    main()
