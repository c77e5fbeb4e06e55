"""Every figure of RELIABILITY.md in one run: API fuzzing, isolation attacks, fault injection, load, proxy attack.

Each part is its own script or test module (named below); this one runs them one after the other, keeps their
output in a log folder, reads their `RESULT` lines (and pytest's JUnit XML for the fault tests) and prints the
table RELIABILITY.md holds, then one last line:

    RESULT api_5xx=<n> api_cases=<n> faults_passed=<k>/<m> lost_records=<n> load_recorded_equals_sent=<bool>
           isolation_escapes=<n> cross_run_key_escapes=<n> disk_left_by_succeeded_rollouts_mb=<x>
           live_workdirs_lost=<n>

Database and Redis come from the environment as for any test run (DATABASE_URL, REDIS_URL,
LIGHTNING_TEST_REDIS_DB). The fault tests and the proxy benchmarks start vLLM, Celery workers and servers of
their own; the whole run takes about half an hour on 2 cores at full size.

    .venv/bin/python bench/reliability.py                 # full size (the figures in RELIABILITY.md)
    .venv/bin/python bench/reliability.py --quick         # CI-sized budgets, to check the command itself
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAULT_TESTS = ["tests/e2e/test_faults_user_code.py", "tests/e2e/test_faults_infra.py",
               "tests/e2e/test_faults_redis_websocket.py"]


@dataclass
class Part:
    name: str
    argv: list[str]
    figures: dict[str, str] = field(default_factory=dict)
    exit_code: int | None = None
    seconds: float = 0.0
    log: Path | None = None


def parse_result(text: str) -> dict[str, str]:
    """The key=value pairs of the last `RESULT` line of a script's output ({} when it printed none)."""
    lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
    if not lines:
        return {}
    return dict(pair.split("=", 1) for pair in lines[-1].split()[1:] if "=" in pair)


def run_part(part: Part, logs: Path, env: dict[str, str]) -> Part:
    part.log = logs / f"{part.name}.log"
    print(f"[reliability] {part.name}: {' '.join(part.argv)}", file=sys.stderr, flush=True)
    started = time.monotonic()
    with part.log.open("w") as log:
        part.exit_code = subprocess.run(part.argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    part.seconds = time.monotonic() - started
    part.figures = parse_result(part.log.read_text(errors="replace"))
    print(f"[reliability] {part.name}: exit {part.exit_code} in {part.seconds:.0f} s {part.figures}",
          file=sys.stderr, flush=True)
    return part


def junit_cases(path: Path) -> list[tuple[str, str]]:
    """(test id, outcome) for every case of a JUnit XML file: passed, failed, error or skipped."""
    if not path.exists():
        return []
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = "failed" if child.tag == "failure" else child.tag
        cases.append((f"{case.get('classname', '')}::{case.get('name', '')}", outcome))
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI-sized budgets instead of the full counts")
    parser.add_argument("--parts", default="", help="comma-separated subset of the parts to run (default: all)")
    parser.add_argument("--logs", type=Path, default=None, help="folder for every part's output (default: a temp one)")
    args = parser.parse_args()
    logs = args.logs or Path(tempfile.mkdtemp(prefix="reliability-"))
    logs.mkdir(parents=True, exist_ok=True)
    python = sys.executable
    junit = logs / "faults.xml"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    parts = [
        Part("api_fuzz", [python, "bench/api_fuzz.py", "--examples", "25" if args.quick else "100"]),
        Part("isolation", [python, "bench/isolation_attacks.py"]),
        Part("disk", [python, "bench/disk_reclaim.py"]),
        Part("faults", [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *FAULT_TESTS]),
        Part("load", [python, "bench/proxy_load.py"] + (["--harnesses", "16", "--calls", "40"] if args.quick else [])),
        Part("proxy_attack", [python, "bench/proxy_attack.py"] + (["--rounds", "1"] if args.quick else [])),
    ]
    if args.parts:
        wanted = set(args.parts.split(","))
        unknown = wanted - {part.name for part in parts}
        if unknown:
            parser.error(f"unknown parts {sorted(unknown)}; choose from {[part.name for part in parts]}")
        parts = [part for part in parts if part.name in wanted]
    for part in parts:
        run_part(part, logs, env)
    by_name = {part.name: part for part in parts}

    cases = junit_cases(junit)
    passed = sum(1 for _, outcome in cases if outcome == "passed")
    load = by_name.get("load", Part("not run", [])).figures
    sent, recorded = int(load.get("load_calls_sent", 0)), int(load.get("load_calls_recorded", -1))
    # Each fault test compares the calls its harnesses got answers for with the rows recorded and fails on any
    # difference, so a lost record in a fault shows in faults_passed; lost_records counts the load's.
    lost = sent - recorded if recorded >= 0 else -1
    none = Part("not run", [])
    api = by_name.get("api_fuzz", none).figures
    isolation = by_name.get("isolation", none).figures

    print("\n| part | command | exit | seconds | figures |\n|---|---|---|---|---|")
    for part in parts:
        shown = " ".join(f"{k}={v}" for k, v in part.figures.items()) or "(no RESULT line: see its log)"
        print(f"| {part.name} | `{' '.join(Path(a).name if a == python else a for a in part.argv)}` | "
              f"{part.exit_code} | {part.seconds:.0f} | {shown} |")
    print("\n| fault test | outcome |\n|---|---|")
    for test_id, outcome in cases:
        print(f"| {re.sub(r'^.*::', '', test_id)} | {outcome} |")
    print(f"\nlogs: {logs}")
    equal = "true" if recorded == sent and sent > 0 else "false"
    print(f"RESULT api_5xx={api.get('api_5xx', 'none')} api_cases={api.get('api_cases', 0)} "
          f"faults_passed={passed}/{len(cases)} lost_records={lost} load_recorded_equals_sent={equal} "
          f"isolation_escapes={isolation.get('isolation_escapes', 'none')} "
          f"cross_run_key_escapes={isolation.get('cross_run_key_escapes', 'none')} "
          f"disk_left_by_succeeded_rollouts_mb="
          f"{by_name.get('disk', none).figures.get('disk_left_by_succeeded_rollouts_mb', 'none')} "
          f"live_workdirs_lost={by_name.get('disk', none).figures.get('live_workdirs_lost', 'none')}")
    failed = [part.name for part in parts if part.exit_code != 0]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
