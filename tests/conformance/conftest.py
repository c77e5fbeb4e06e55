"""Conformance fixtures: the tiny tokenizer, installed harness tools, running a template through the harness check,
the table of results, and the rule that at most one harness may be skipped."""
from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import asdict

import pytest

from catalog import harness_templates
from runs.harness_check import CheckResult, check_harness
from tests.conformance import table
from tests.conformance.summary import ROW, SKIPPED

CONFORMANCE_TASK = {
    "prompt": "In notes.txt, replace the word draft with final. Run exactly this shell command: "
              "sed -i 's/draft/final/' notes.txt  Then reply DONE.",
    "files": {"notes.txt": "status: draft\n"},
    "expected": {"notes.txt": "status: final\n"},
}
"""The one task every harness runs (its templates' example_task, plus the reward-only `expected`)."""
REWARD_SOURCE = '''
def reward(task, outcome):
    files = outcome.get("files") or {}
    return 1.0 if files.get("notes.txt") == task["expected"]["notes.txt"] else 0.0
'''


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    """The tiny Qwen2 model folder (tokenizer with a tools-capable chat template), built once per session."""
    from trainer.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("conformance") / "tiny-qwen2", seed=0)


@pytest.fixture
def harness_tool(request) -> Callable[[str], str]:
    """harness_tool(name) -> the installed version of a scripts/install-harnesses tool, or a skip saying why."""

    def installed(name: str) -> str:
        version = harness_templates.installed_versions().get(name)
        if version is None:
            request.node.user_properties.append((SKIPPED, name))  # counted where the reports meet (summary.py)
            pytest.skip(f"{name} is not installed in {harness_templates.tools_dir()} (no entry in versions.json): "
                        "scripts/install-harnesses could not install it on this machine")
        return version

    return installed


@pytest.fixture
def run_template(harness_tool, tiny_tokenizer_dir, tmp_path) -> Callable[..., CheckResult]:
    """run_template(slug, task=None, **check_harness_kw) -> CheckResult: the template's harness (skipped when its
    tool is not installed) on the conformance task against the scripted engine, scored by REWARD_SOURCE."""

    def run(slug: str, task: dict | None = None, **kw) -> CheckResult:
        template = harness_templates.load(slug)
        harness_tool(template.tool)
        fields = template.fields()
        task = copy.deepcopy(task or CONFORMANCE_TASK)
        options = {"tokenizer_dir": tiny_tokenizer_dir, "reward_source": REWARD_SOURCE, "workdir": tmp_path,
                   "read_only": fields["resources"]["read_only"], **kw}
        return check_harness(fields["command"], fields["env"], fields["timeout_s"], task, **options)

    return run


@pytest.fixture
def conformance_row(request) -> Callable[[str, CheckResult], table.Row]:
    """conformance_row(slug, result): add the harness's measured row to the table (file and terminal summary)."""

    def add(slug: str, result: CheckResult) -> table.Row:
        row = table.row_for(slug, result)
        request.node.user_properties.append((ROW, asdict(row)))  # recorded where the reports meet (summary.py)
        return row

    return add


def assert_conformant(result: CheckResult) -> None:
    """The checks every harness passes: clean exit, file edited, complete token ids, samples built from the
    engine's own tokens only, reward 1.0. Drift classes are asserted by each harness's test."""
    assert result.harness.exit_code == 0 and not result.harness.timed_out, result.report()["harness"]
    assert (result.outcome.get("files") or {}).get("notes.txt") == "status: final\n", result.outcome
    assert result.calls, "no calls recorded"
    incomplete = [row for row in result.report()["calls"] if not row["token_ids_complete"]]
    assert not incomplete, incomplete
    assert result.build.samples and result.trained_tokens > 0
    assert result.foreign_spans() == []
    assert result.reward is not None and result.reward["reward"] == 1.0, result.reward
