"""In CI a test skipped because the sandbox, the engine venv or Chromium is missing fails: a green CI means the
isolation, engine and browser suites ran (the tests.ci_required plugin)."""
import os
import subprocess
import sys
from pathlib import Path

from tests.ci_required import ci_requires

ROOT = Path(__file__).resolve().parents[2]

SKIPS = '''
import pytest

def test_engine():
    pytest.skip("no engine venv at /nowhere: run scripts/setup-engine")

@pytest.mark.skipif(True, reason="bubblewrap cannot run on this machine")
def test_sandbox():
    pass

def test_other():
    pytest.skip("cuts a PostgreSQL connection")
'''


def test_the_rule_matches_missing_tools_only_in_ci():
    assert ci_requires("no engine venv at /x: run scripts/setup-engine", {"CI": "true"})
    assert ci_requires("Debian's chromium is not installed (.ci/run installs it)", {"CI": "1"})
    assert ci_requires("bubblewrap cannot run here", {"CI": "true"})
    assert not ci_requires("bubblewrap cannot run here", {})
    assert not ci_requires("no engine venv at /x", {"CI": "false"})
    assert not ci_requires("PostgreSQL's plan depends on the table's size", {"CI": "true"})


def run_skips(tmp_path, ci: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "test_skips.py").write_text(SKIPS)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "DJANGO_SETTINGS_MODULE")}
    if ci is not None:
        env["CI"] = ci
    # The plugin on a test file outside the tree (no ini file there, so no Django either).
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:django",
                           "-p", "tests.ci_required", "--rootdir", str(tmp_path), str(tmp_path / "test_skips.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_in_ci_a_missing_tool_fails_the_test_and_elsewhere_it_skips(tmp_path):
    ci = run_skips(tmp_path, "true")
    assert ci.returncode == 1, ci.stdout
    # A skip in the test fails it; a skipif mark skips in setup, which becomes an error: both fail the run.
    assert "1 failed, 1 skipped, 1 error" in ci.stdout
    assert "CI needs what this test skipped for: no engine venv at /nowhere" in ci.stdout
    local = run_skips(tmp_path, None)
    assert local.returncode == 0 and "3 skipped" in local.stdout, local.stdout
