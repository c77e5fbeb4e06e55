"""A pytest plugin (tests/conftest.py loads it): in CI (CI set, as .ci/run runs) a test skipped because the
sandbox, the engine venv or Chromium is missing fails instead, so a green CI means the isolation, engine and browser
suites ran. Matched on the skip's reason; no Django here, so it loads in any pytest run."""
from __future__ import annotations

import os

import pytest

CI_REQUIRED_TOOLS = ("no engine venv", "bubblewrap cannot run", "chromium is not installed")


def ci_requires(reason: str, env: dict | None = None) -> bool:
    """Whether a skip with this reason is a CI failure (a required tool is missing while CI is set)."""
    ci = (os.environ if env is None else env).get("CI", "").lower() not in ("", "0", "false", "no")
    return ci and any(tool in reason.lower() for tool in CI_REQUIRED_TOOLS)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and isinstance(report.longrepr, tuple) and ci_requires(str(report.longrepr[2])):
        report.outcome = "failed"
        reason = str(report.longrepr[2]).removeprefix("Skipped: ")
        report.longrepr = f"CI needs what this test skipped for: {reason}"
