"""Runs one harness attempt as a local subprocess: placeholders filled, scrubbed env, timeout, bounded output,
isolated by sandbox.isolation (its workdir, its read-only paths and the proxy; nothing of the app), its workdir's
disk use watched."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path

from django.conf import settings

from common.procs import signal_group
from sandbox import harness as sandbox_harness
from sandbox import isolation
from sandbox.executors.base import PASSED_ENV, PLACEHOLDERS, TAIL_BYTES, Attempt, Outcome, read_outcome

DISK_POLL_S = 1.0
"""How often the workdir's size is measured against the attempt's disk limit."""


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
                sandbox_harness.resolve_program(argv[0], env.get("PATH"), attempt.workdir)
                command = await stack.enter_async_context(sandbox_harness.harness_sandbox(
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
        outcome = read_outcome(output_file, code, stdout)
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
