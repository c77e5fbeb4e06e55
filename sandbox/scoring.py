"""The reward sandbox: user Python in a separate, limited process; every failure becomes a readable result."""
from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.procs import signal_group
from sandbox import isolation
from sandbox import limits as sandbox_limits

RUNNER = Path(__file__).with_name("runner.py")
SAFE_ENV_KEYS = ("PATH", "LANG", "LC_ALL", "TZ")
OUTPUT_TAIL_CHARS = 4096  # what a result keeps of the script's prints
RESULT_BYTES = 4 * 1024 * 1024  # the most of a result (reward and detail JSON) read back


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0
    memory_mb: int = 512
    output_bytes: int = 64 * 1024
    file_bytes: int = 16 * 1024 * 1024


@dataclass(frozen=True)
class ScoreResult:
    ok: bool
    reward: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    kind: str = ""  # exception | syntax | timeout | memory | output | crashed | invalid | refused (no isolation)
    # | unparseable (the script raised UnparseableOutcome: the policy's failure, see sandbox/runner.py)
    output: str = ""
    duration_ms: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "reward": self.reward, "detail": self.detail, "error": self.error,
                "kind": self.kind, "output": self.output, "duration_ms": round(self.duration_ms, 1)}


def score(source: str, task: Any, outcome: Any, limits: Limits = Limits()) -> ScoreResult:
    """Run reward(task, outcome) from `source` in a child process under `limits`, isolated by sandbox.isolation."""
    started = time.monotonic()
    try:
        stdin = json.dumps({"source": source, "task": task, "outcome": outcome}).encode()
    except (TypeError, ValueError) as exc:
        return ScoreResult(ok=False, kind="invalid", error=f"task or outcome is not JSON: {exc}")
    try:
        iso = isolation.current()
    except isolation.IsolationError as exc:
        return ScoreResult(ok=False, kind="refused", error=str(exc))
    with tempfile.TemporaryDirectory(prefix="reward-") as workdir:
        pids = sandbox_limits.PidsLimit(isolation.REWARD_PIDS) if iso.bwrap else None
        try:
            return _run(iso, pids, stdin, workdir, limits, started)
        finally:
            if pids is not None:
                pids.close()


def _run(iso: isolation.Isolation, pids: sandbox_limits.PidsLimit | None, stdin: bytes, workdir: str, limits: Limits,
         started: float) -> ScoreResult:
    # No preexec_fn: it forces a fork, which copies the page tables of this (a worker holds GBs of trainer)
    # process, 0.23 s per score at 4 GB resident against 0.02 s for the vfork Popen uses without one. The runner
    # sets its limits itself before it reads the script from stdin, so no user code runs before them. Isolated,
    # its workdir is the sandbox's private size-limited /tmp (`workdir` stays empty); the result comes back on a
    # pipe either way.
    read_fd, write_fd = os.pipe()
    memory, cpu = limits.memory_mb * 1024 * 1024, int(limits.timeout_s) + 1
    nproc = sandbox_limits.nproc_limit(isolation.REWARD_PIDS) if iso.bwrap else 0
    python = isolation.interpreter() if iso.bwrap else sys.executable
    runner = isolation.code_inside(RUNNER) if iso.bwrap else str(RUNNER)
    argv = [python, "-I", "-B", runner, str(write_fd), str(memory), str(cpu), str(limits.file_bytes),
            str(nproc)]
    home = "/tmp" if iso.bwrap else workdir
    if iso.bwrap:
        argv = pids.wrap(isolation.reward_argv(iso, argv, RUNNER))
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, pass_fds=(write_fd,),
            cwd=workdir, env=_scrubbed_env(home), start_new_session=True)
    finally:
        os.close(write_fd)
    with os.fdopen(read_fd, "rb") as results:
        output, result, overflow, timed_out = _communicate(proc, results, stdin, limits)
    elapsed = (time.monotonic() - started) * 1000
    text = output.decode("utf-8", "replace")[-OUTPUT_TAIL_CHARS:]
    if timed_out:
        return ScoreResult(False, kind="timeout", output=text, duration_ms=elapsed,
                           error=f"the reward script timed out after {limits.timeout_s:g} s")
    if overflow:
        return ScoreResult(False, kind="output", output=text, duration_ms=elapsed,
                           error=f"the reward script printed more than {limits.output_bytes} bytes; stopped")
    returncode = proc.returncode
    if iso.bwrap and returncode is not None and 128 < returncode < 128 + 65:
        returncode = 128 - returncode  # bwrap reports a signal N that ended the runner as 128 + N
    return _read_result(returncode, result, text, elapsed, limits)


def _scrubbed_env(workdir: str) -> dict[str, str]:
    """Only harmless variables survive: no database URL, secret key or tokens reach user code."""
    env = {key: os.environ[key] for key in SAFE_ENV_KEYS if key in os.environ}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env.update({"HOME": workdir, "TMPDIR": workdir, "PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8",
                "OMP_NUM_THREADS": "1"})
    return env


def _communicate(proc: subprocess.Popen, results, stdin: bytes, limits: Limits) -> tuple[bytes, bytes, bool, bool]:
    """Feed stdin, collect at most `output_bytes` of output and RESULT_BYTES of result, kill the group on overflow
    or timeout."""
    try:
        proc.stdin.write(stdin)
        proc.stdin.close()
    except BrokenPipeError:
        pass
    deadline = time.monotonic() + limits.timeout_s
    chunks, result, size, overflow, timed_out = [], bytearray(), 0, False, False
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        selector.register(results, selectors.EVENT_READ)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            events = selector.select(timeout=min(remaining, 0.5))
            if not events and proc.poll() is not None:
                break
            for key, _ in events:
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                elif key.fileobj is results:
                    result += chunk[: max(0, RESULT_BYTES - len(result))]
                else:
                    chunks.append(chunk)
                    size += len(chunk)
            if size > limits.output_bytes:
                overflow = True
                break
    if timed_out or overflow:
        _kill_group(proc)
    try:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc)
        proc.wait()
    proc.stdout.close()
    return b"".join(chunks)[: limits.output_bytes], bytes(result), overflow, timed_out


def _kill_group(proc: subprocess.Popen) -> None:
    signal_group(proc.pid, signal.SIGKILL)


def _read_result(returncode: int, result: bytes, output: str, elapsed: float, limits: Limits) -> ScoreResult:
    if result:
        try:
            data = json.loads(result)
        except ValueError:
            data = None
        if isinstance(data, dict):
            if data.get("ok"):
                return ScoreResult(True, reward=data["reward"], detail=data.get("detail") or {},
                                   output=output, duration_ms=elapsed)
            return ScoreResult(False, kind=data.get("kind", "exception"), error=data.get("error", ""),
                               output=output, duration_ms=elapsed)
    if returncode is not None and returncode < 0:
        name = signal.Signals(-returncode).name
        if -returncode == signal.SIGXCPU:
            return ScoreResult(False, kind="timeout", output=output, duration_ms=elapsed,
                               error=f"the reward script used more than {limits.timeout_s:g} s of CPU")
        return ScoreResult(False, kind="crashed", output=output, duration_ms=elapsed,
                           error=f"the reward script was killed by {name} (memory limit {limits.memory_mb} MB?)")
    hint = "out of memory" if "MemoryError" in output else f"exit code {returncode}"
    kind = "memory" if "MemoryError" in output else "crashed"
    return ScoreResult(False, kind=kind, output=output, duration_ms=elapsed,
                       error=f"the reward script ended without a result ({hint})")
