"""API fuzzing at full count: tests/api/test_api_fuzz.py with a larger per-operation budget, then its figures.

The test holds the fixture (a user owning a harness, dataset, reward script and run) and pytest-django's throw-away
database, so this script only sets the budget, runs it and summarises the counts the test writes. Database and Redis
come from the environment as for any test run (DATABASE_URL, LIGHTNING_TEST_REDIS_DB).

    .venv/bin/python bench/api_fuzz.py --examples 40
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST = "tests/api/test_api_fuzz.py::test_every_operation_survives_generated_cases"


def run_fuzz(examples: int) -> tuple[dict, float, int]:
    """The test's counts file, its wall time and pytest's exit code."""
    with tempfile.TemporaryDirectory() as tmp:
        counts_file = Path(tmp) / "counts.json"
        env = {**os.environ, "LIGHTNING_FUZZ_EXAMPLES": str(examples), "LIGHTNING_FUZZ_COUNTS_FILE": str(counts_file)}
        started = time.monotonic()
        code = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", TEST],
                              cwd=ROOT, env=env, stdout=sys.stderr).returncode
        elapsed = time.monotonic() - started
        if not counts_file.exists():
            raise SystemExit(f"the fuzz test wrote no counts (pytest exit {code}); see its output above")
        return json.loads(counts_file.read_text()), elapsed, code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=40, help="generated cases per operation (at most)")
    args = parser.parse_args()
    report, elapsed, code = run_fuzz(args.examples)
    counts, failures = report["counts"], report["failures"]
    for operation, n in sorted(counts.items(), key=lambda item: item[0].split(" ", 1)[::-1]):
        print(f"{n:6d}  {operation}")
    for failure in failures:
        print(f"FAIL {failure['operation']} -> {failure['status']}\n{failure['message']}", file=sys.stderr)
    server_errors = sum(1 for f in failures if f["status"] >= 500)
    cases = sum(counts.values())
    print(f"{len(counts)} operations, {cases} cases in {elapsed:.0f} s (pytest exit {code})")
    print(f"RESULT api_5xx={server_errors} api_cases={cases} schema_failures={len(failures) - server_errors}")


if __name__ == "__main__":
    main()
