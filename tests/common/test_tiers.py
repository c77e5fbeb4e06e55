"""The two tiers (tests/tiers.py): `./lw test` selects no test that starts vLLM, Chromium, real agents or Celery
workers, and the fast and full tiers together hold every collected test."""
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.tiers import _starts

ROOT = Path(__file__).resolve().parents[2]

FULL_MARKERS = {"slow", "e2e", "browser", "vllm", "conformance"}
HEAVY_FIXTURES = {
    "browser": "Chromium", "page": "Chromium", "console": "Chromium", "live_url": "a daphne process",
    "workers": "Celery workers", "control_worker": "a Celery worker", "harness_tool": "the real agents",
    "run_template": "the real agents",
}
"""Fixtures of this suite that start what the fast tier leaves out (by their names, as tests request them)."""
SAMPLES = '''
def starts_workers(tmp_path):
    return Workers(tmp_path)

def calls_a_helper_that_starts_workers(tmp_path):
    return starts_workers(tmp_path)

def opens_chromium_in_a_closure():
    def launch():
        from playwright.sync_api import sync_playwright
        return sync_playwright
    return launch

def reads_the_database(workers):
    return wait_db(lambda: True, "nothing", workers)
'''


@pytest.fixture(scope="module")
def collected(tmp_path_factory):
    """(`./lw test --collect-only -q` output, the tier report of every collected test)."""
    report_path = tmp_path_factory.mktemp("tiers") / "tiers.json"
    proc = subprocess.run([str(ROOT / "lw"), "test", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "--tier-report", str(report_path)], cwd=ROOT, env=dict(os.environ),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(report_path.read_text())


def test_the_fast_selection_leaves_out_every_heavy_test_and_the_two_tiers_hold_every_test(collected):
    output, report = collected
    selected = {line for line in output.splitlines() if "::" in line}
    counts = re.search(r"(\d+)/(\d+) tests collected \((\d+) deselected\)", output)
    assert counts, output[-2000:]
    n_selected, n_collected, n_deselected = map(int, counts.groups())

    fast = {row["nodeid"] for row in report if row["tier"] == "fast"}
    full = {row["nodeid"] for row in report if row["tier"] == "full"}
    assert len(report) == n_collected == len(fast) + len(full)
    assert selected == fast and len(selected) == n_selected
    assert len(full) == n_deselected and full, "the full tier is empty"
    assert all(row["reason"] for row in report if row["tier"] == "full")

    for row in report:
        if row["nodeid"] in selected:
            heavy = (FULL_MARKERS & set(row["markers"])) | (HEAVY_FIXTURES.keys() & set(row["fixtures"]))
            assert not heavy, f"{row['nodeid']} is in the fast tier with {heavy}"
            assert not row["nodeid"].startswith(("tests/e2e/", "tests/browser/", "tests/conformance/")), row


def test_a_fixture_that_starts_workers_puts_its_tests_in_the_full_tier_without_a_marker(collected):
    """The reward script API's control_worker wraps `workers`: the tests that use it carry no marker of their own."""
    rows = {row["nodeid"].rsplit("::", 1)[1]: row for row in collected[1]}
    scored = rows["test_the_test_action_scores_in_the_sandbox"]
    assert scored["tier"] == "full" and not FULL_MARKERS & set(scored["markers"])
    assert scored["reason"] == "fixture workers starts Celery worker processes"
    assert rows["test_the_test_action_needs_task_and_outcome"]["tier"] == "fast"


def test_what_a_function_starts_is_found_through_helpers_and_closures_under_tests():
    namespace = {"__name__": "tests.samples"}
    exec(SAMPLES, namespace)  # names referenced by these functions only: nothing here calls them
    assert _starts(namespace["starts_workers"], set()) == "Celery worker processes"
    assert _starts(namespace["calls_a_helper_that_starts_workers"], set()) == "Celery worker processes"
    assert _starts(namespace["opens_chromium_in_a_closure"], set()) == "Chromium"
    assert _starts(namespace["reads_the_database"], set()) is None
