"""Runs one harness attempt as a local subprocess: placeholders filled, scrubbed env, timeout, bounded output,
isolated by runs.isolation (its workdir, its read-only paths and the proxy; nothing of the app), its workdir's
disk use watched."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.conf import settings

from common.procs import signal_group
from runs import isolation

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
DISK_POLL_S = 1.0
"""How often the workdir's size is measured against the attempt's disk limit."""


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
    """Absolute paths the harness is shown read-only (its harness's resources["read_only"]); see runs.isolation
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


class LocalExecutor:
    """One subprocess per attempt, in its own process group so a timeout or cancel kills all it started."""

    async def run(self, attempt: Attempt) -> Outcome:
        attempt.workdir.mkdir(parents=True, exist_ok=True)
        task_file, output_file = attempt.workdir / "task.json", attempt.workdir / "output.json"
        task_file.write_text(json.dumps(attempt.task))
        values = {"task_file": str(task_file), "output_file": str(output_file), "task_id": attempt.task_id,
                  "workdir": str(attempt.workdir), "base_url": attempt.base_url, "api_key": attempt.api_key,
                  "model": attempt.model, "rollout_id": attempt.rollout_id}
        assert values.keys() == PLACEHOLDERS.keys(), "PLACEHOLDERS names what the executor fills"
        argv = [arg.format(**values) for arg in attempt.command]
        env = _env(attempt, values)
        disk = (attempt.disk_mb or settings.LIGHTNING_HARNESS_DISK_MB) * 1024 * 1024
        started = time.monotonic()
        async with contextlib.AsyncExitStack() as stack:
            try:
                isolation.resolve_program(argv[0], env.get("PATH"), attempt.workdir)
                command = await stack.enter_async_context(isolation.harness_sandbox(
                    argv, env, attempt.workdir, attempt.read_only, attempt.base_url, disk))
                proc = await asyncio.create_subprocess_exec(
                    *command, cwd=attempt.workdir, env=env, stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
            except (OSError, isolation.IsolationError) as exc:
                return Outcome(None, False, "", "", seconds=0.0, error=f"harness could not start: {exc}")
            try:
                stdout, stderr, stopped = await _collect(proc, attempt.timeout_s, attempt.workdir, disk)
            except asyncio.CancelledError:
                _kill(proc)
                raise
        seconds = time.monotonic() - started
        code = proc.returncode
        if command is not argv and code is not None and 128 < code < 128 + 65:
            code = 128 - code  # the sandbox reports a signal N that ended the harness as 128 + N: -N as unsandboxed
        outcome = _read_outcome(output_file, code, stdout)
        error = {"timeout": f"harness timed out after {attempt.timeout_s:g} s",
                 "disk": f"harness stopped: its workdir grew past {disk // (1024 * 1024)} MB (the disk limit)"
                 }.get(stopped) or (f"harness exited with code {code}" if code else "")
        return Outcome(code, stopped == "timeout", stdout, stderr, outcome, seconds, error)


def _env(attempt: Attempt, values: dict[str, str]) -> dict[str, str]:
    """The harness sees its own env and the rollout's endpoint and key, never the app's secrets."""
    env = {key: os.environ[key] for key in PASSED_ENV if key in os.environ}
    env.update(HOME=str(attempt.workdir), TMPDIR=str(attempt.workdir))
    env.update({key: value.format(**values) for key, value in attempt.env.items()})
    anthropic_base = attempt.base_url.removesuffix("/v1")
    env.update(OPENAI_BASE_URL=attempt.base_url, OPENAI_API_KEY=attempt.api_key, ANTHROPIC_BASE_URL=anthropic_base,
               ANTHROPIC_API_KEY=attempt.api_key, LIGHTNING_TASK_FILE=values["task_file"],
               LIGHTNING_OUTPUT_FILE=values["output_file"], LIGHTNING_ROLLOUT_ID=attempt.rollout_id,
               LIGHTNING_MODEL=attempt.model)
    return env


async def _collect(proc, timeout_s: float, workdir: Path, disk_bytes: int) -> tuple[str, str, str]:
    """Read both pipes keeping the last TAIL_BYTES of each; kill the group on timeout ("timeout") or when the
    workdir outgrows `disk_bytes` ("disk")."""
    tails = {"out": bytearray(), "err": bytearray()}

    async def drain(stream, key):
        while chunk := await stream.read(65536):
            tails[key] += chunk
            del tails[key][:-TAIL_BYTES]

    readers = asyncio.gather(drain(proc.stdout, "out"), drain(proc.stderr, "err"), proc.wait())
    # A cancelled attempt kills the process and leaves the readers behind: mark their outcome as seen.
    readers.add_done_callback(lambda done: done.cancelled() or done.exception())
    watcher = asyncio.ensure_future(_outgrows(workdir, disk_bytes))
    try:
        done, _ = await asyncio.wait({readers, watcher}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    stopped = "" if readers in done else "disk" if watcher in done else "timeout"
    if stopped:
        _kill(proc)
        await readers
    return tails["out"].decode("utf-8", "replace"), tails["err"].decode("utf-8", "replace"), stopped


async def _outgrows(workdir: Path, limit: int) -> None:
    """Returns once the workdir holds more than `limit` bytes. A workdir of many files is measured less often:
    the walk takes at most about 5% of one core."""
    pause = DISK_POLL_S
    while True:
        await asyncio.sleep(pause)
        started = time.monotonic()
        if await asyncio.to_thread(disk_usage, workdir) > limit:
            return
        pause = max(DISK_POLL_S, 20 * (time.monotonic() - started))


def disk_usage(root: Path) -> int:
    """Bytes of disk the files under `root` take (symlinks not followed)."""
    total, stack = 0, [str(root)]
    while stack:
        try:
            with os.scandir(stack.pop()) as entries:
                for entry in entries:
                    with contextlib.suppress(OSError):
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(entry.path)
                        else:
                            total += entry.stat(follow_symlinks=False).st_blocks * 512
        except OSError:
            continue
    return total


def _kill(proc) -> None:
    signal_group(proc.pid, signal.SIGKILL)


def _read_outcome(output_file: Path, exit_code: int | None, stdout: str) -> dict[str, Any]:
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
