"""What every harness executor shares: the attempt it runs, the outcome it returns, the `{placeholders}`, the
Executor protocol and its setup error."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

TAIL_BYTES = 16 * 1024


PLACEHOLDERS: dict[str, str] = {
    "task_file": "path of a JSON file holding the task (its reward-only fields left out)",
    "output_file": "where the harness writes its outcome: the JSON object the reward script receives",
    "task_id": "the task's id in its dataset",
    "workdir": "the rollout's own working folder (also its HOME and TMPDIR)",
    "base_url": "the rollout's OpenAI-compatible base URL (…/rollouts/<id>/v1) on the proxy",
    "api_key": "the rollout's own API key for that URL",
    "model": "the model name to ask the proxy for",
    "rollout_id": "the rollout's id",
}
"""The `{placeholders}` a harness argv or env value may use (filled per attempt below) and what each stands for:
the API's validation and the harness page's list both read this."""


PASSED_ENV = ("PATH", "LANG", "LC_ALL", "TZ", "TERM")


@dataclass(frozen=True)
class Attempt:
    """What one harness run needs: the argv template, its env, the task and where the proxy serves it."""

    command: list[str]
    env: dict[str, str]
    timeout_s: float
    workdir: Path
    task_id: str
    task: dict[str, Any]  # as the harness may see it: reward-only fields already left out (Run.harness_task)
    rollout_id: str
    base_url: str  # the rollout's OpenAI base URL (…/rollouts/<id>/v1)
    api_key: str
    model: str = "policy"
    read_only: tuple[str, ...] = ()
    """Absolute paths the harness is shown read-only (its harness's resources["read_only"]); see sandbox.isolation
    for what else it sees."""
    disk_mb: int | None = None
    """The most its workdir may hold (and the largest file it may write); None: LIGHTNING_HARNESS_DISK_MB."""
    run_id: str = ""
    step: int | None = None
    """The run and the step (policy version) the rollout belongs to: labels on a Kubernetes Job."""


@dataclass(frozen=True)
class Outcome:
    exit_code: int | None
    timed_out: bool
    stdout_tail: str
    stderr_tail: str
    outcome: dict[str, Any] = field(default_factory=dict)  # what the reward function receives
    seconds: float = 0.0
    error: str = ""


def read_outcome(output_file: Path, exit_code: int | None, stdout: str) -> dict[str, Any]:
    """The harness's output file (a JSON object) plus its exit code and stdout tail."""
    text = output_file.read_text(errors="replace")[:OUTPUT_MAX_CHARS] if output_file.is_file() else None
    return parse_outcome(text, exit_code, stdout)


OUTPUT_MAX_CHARS = 10 * 1024 * 1024


def parse_outcome(text: str | None, exit_code: int | None, stdout: str) -> dict[str, Any]:
    """The outcome the reward function receives from the output file's text (None: no file): a JSON object as is,
    other JSON as {"output": value}, anything else as {"output_raw": text}; plus the exit code and stdout tail."""
    data: dict[str, Any] = {}
    if text is not None:
        try:
            loaded = json.loads(text)
            data = loaded if isinstance(loaded, dict) else {"output": loaded}
        except ValueError:
            data = {"output_raw": text[:TAIL_BYTES]}
    data.setdefault("exit_code", exit_code)
    data.setdefault("stdout", stdout[-4096:])
    return data


KINDS = ("local", "kubernetes")
"""The executors a harness may name (catalog.models.Executor)."""


class ExecutorSetupError(Exception):
    """The executor a harness names cannot run here: unknown, or its cluster or proxy address is not set up. The
    message names the fix."""


class Executor(Protocol):
    async def run(self, attempt: Attempt) -> Outcome:
        """Run one harness attempt to its end and say how it went. Cancelling it stops the harness."""
        ...

