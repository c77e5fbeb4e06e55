"""Kernel limits of a sandboxed process: a pids and memory cgroup per harness or reward script where the host
delegates one, RLIMIT_NPROC otherwise."""
from __future__ import annotations

import contextlib
import functools
import os
import shlex
import signal
import time
import uuid
from pathlib import Path


@functools.lru_cache(maxsize=1)
def pids_root() -> Path | None:
    """A writable cgroup (v1 pids hierarchy, or v2 with the pids controller) to make per-sandbox groups in."""
    found = _controller_root("pids", "pids.max")
    return found[0] if found else None


def _controller_root(controller: str, v2_limit_file: str, v1_limit_file: str | None = None) -> tuple[Path, str] | None:
    """(the first writable of cgroup v1's `controller` hierarchy and v2 with that controller, its limit file)."""
    v2 = Path("/sys/fs/cgroup")
    candidates = [(v2 / controller, v1_limit_file or v2_limit_file)]
    try:
        if controller in (v2 / "cgroup.subtree_control").read_text().split():
            candidates.append((v2, v2_limit_file))
    except OSError:
        pass
    for root, limit_file in candidates:
        probe_dir = root / f"lightning-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            probe_dir.mkdir()
            probe_dir.rmdir()
        except OSError:
            continue
        _remove_stale(root)
        return root, limit_file
    return None


def _remove_stale(root: Path) -> None:
    """Remove the empty sandbox cgroups a process that died (a SIGKILLed worker) left behind."""
    for path in root.glob("lightning-*-*"):
        owner = path.name.split("-")[1]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            with contextlib.suppress(OSError):
                path.rmdir()  # fails while a task is still inside: then it is not stale


@functools.lru_cache(maxsize=1)
def memory_root() -> tuple[Path, str] | None:
    """(a writable cgroup to make per-sandbox memory groups in, its limit file): cgroup v1's memory hierarchy, or
    v2 with the memory controller; None where there is none (harnesses then get RLIMIT_AS)."""
    return _controller_root("memory", "memory.max", "memory.limit_in_bytes")


class PidsLimit:
    """Cgroups of its own for one sandbox: capped at `limit` tasks and, with `memory_mb` where a memory cgroup is
    writable, at that much memory (the kernel kills the sandbox's processes past it); `wrap(argv)` moves the process
    in before bwrap starts; `close()` kills whatever is left in them and removes them. A no-op where no cgroup is
    writable."""

    def __init__(self, limit: int, memory_mb: int | None = None):
        self.paths: list[Path] = []
        self.memory_limited = False
        name = f"lightning-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        root = pids_root()
        if root is not None:
            self._make(root / name, "pids.max", str(limit))
        memory = memory_root() if memory_mb else None
        if memory is not None:
            path = memory[0] / name
            if path in self.paths:  # v2: one group holds both limits
                self.memory_limited = self._limit(path, memory[1], str(memory_mb << 20))
            else:
                self.memory_limited = self._make(path, memory[1], str(memory_mb << 20))

    def _make(self, path: Path, limit_file: str, value: str) -> bool:
        try:
            path.mkdir()
        except OSError:
            return False
        if not self._limit(path, limit_file, value):
            with contextlib.suppress(OSError):
                path.rmdir()
            return False
        self.paths.append(path)
        return True

    @staticmethod
    def _limit(path: Path, limit_file: str, value: str) -> bool:
        try:
            (path / limit_file).write_text(value)
        except OSError:
            return False
        return True

    @property
    def path(self) -> Path | None:
        return self.paths[0] if self.paths else None

    def wrap(self, argv: list[str]) -> list[str]:
        if not self.paths:
            return argv
        moves = " && ".join(f"echo $$ > {shlex.quote(str(path / 'cgroup.procs'))}" for path in self.paths)
        return ["/bin/sh", "-c", f'{moves} && exec "$@"', "sh", *argv]

    def members(self) -> list[int]:
        found: set[int] = set()
        for path in self.paths:
            try:
                found.update(int(pid) for pid in (path / "cgroup.procs").read_text().split())
            except (OSError, ValueError):
                pass
        return sorted(found)

    def close(self) -> None:
        deadline = time.monotonic() + 5
        while self.paths:
            for pid in self.members():
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            for path in list(self.paths):
                try:
                    path.rmdir()
                    self.paths.remove(path)
                except OSError:
                    pass
            if self.paths:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.02)
        self.paths = []


def nproc_limit(limit: int) -> int:
    """RLIMIT_NPROC for a sandbox where no cgroup caps it: 0 (none) as root, who ignores it; else this user's
    processes now plus `limit` (the limit counts every process of the user)."""
    if os.getuid() == 0 or pids_root() is not None:
        return 0
    uid = os.getuid()
    mine = 0
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and entry.stat().st_uid == uid:
                mine += 1
    return mine + limit
