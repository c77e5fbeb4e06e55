"""Processes: free ports, process groups (signal, kill, members) and /proc reads (state, command line, memory, CPU).

Stdlib only, so the trainer, the proxy, the app, the benches and the tests can all use it. Linux: where /proc is
missing, the reads answer "nothing found" (empty lists, zeros, None) instead of raising.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

logger = logging.getLogger(__name__)

PROC = Path("/proc")
GONE_STATES = frozenset("ZX")
"""Zombie (exited, waiting for its parent to reap it) and dead: such a process runs no code and holds no memory."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now, chosen by the OS.

    Another process may take it before the caller binds it: where the caller can, bind port 0 and keep the
    socket instead (as proxy.server does); servers started as other processes get this and retry on a clash.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class ProcStat:
    """The fields of /proc/<pid>/stat this project reads."""

    pid: int
    state: str
    """R running, S sleeping, D disk wait, T stopped, Z zombie, X dead, ..."""
    ppid: int
    pgid: int
    cpu_ticks: int
    """User plus system CPU time in clock ticks (os.sysconf('SC_CLK_TCK') per second)."""
    started: int
    """Start time in clock ticks after boot: with the pid, it names one process even once the pid is reused."""

    @property
    def running(self) -> bool:
        """Not exited: a zombie waiting for its reaper does not count."""
        return self.state not in GONE_STATES


def proc_stat(pid: int | str) -> ProcStat | None:
    """The process's stat line parsed, or None when there is no such process."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may itself hold spaces or ')': split after the last ')'.
    head, _, rest = text.rpartition(")")
    fields = rest.split()
    try:
        return ProcStat(pid=int(head.split(" (", 1)[0]), state=fields[0], ppid=int(fields[1]), pgid=int(fields[2]),
                        cpu_ticks=int(fields[11]) + int(fields[12]), started=int(fields[19]))
    except (IndexError, ValueError):
        return None


def pids() -> Iterator[int]:
    """Every process id now in /proc."""
    try:
        entries = list(PROC.iterdir())
    except OSError:
        return
    for entry in entries:
        if entry.name.isdigit():
            yield int(entry.name)


def all_stats() -> Iterator[ProcStat]:
    """Parsed stat of every live or zombie process (those that vanish while being read are skipped)."""
    for pid in pids():
        stat = proc_stat(pid)
        if stat is not None:
            yield stat


def alive(pid: int) -> bool:
    """True while the process exists and has not exited (a zombie is not alive)."""
    stat = proc_stat(pid)
    return stat is not None and stat.running


def cmdline(pid: int) -> str:
    """The process's argv joined with spaces ('' when gone or a kernel thread)."""
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def cwd(pid: int) -> str:
    """The process's working directory ('' when gone or not ours to read)."""
    try:
        return os.readlink(PROC / str(pid) / "cwd")
    except OSError:
        return ""


def environ(pid: int) -> dict[str, str]:
    """The environment the process started with ({} when gone or not ours to read)."""
    try:
        raw = (PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return {}
    pairs = (entry.decode(errors="replace").partition("=") for entry in raw.split(b"\0") if entry)
    return {key: value for key, _, value in pairs}


def names_folder(pid: int, folders: Iterable[str | Path]) -> bool:
    """True when the process works in one of the folders (or below) or names such a path on its command line."""
    roots = [str(folder).rstrip("/") for folder in folders]
    try:
        argv = (PROC / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return False
    paths = [cwd(pid), *(arg.partition("=")[2] if arg.startswith("-") else arg for arg in argv)]
    return any(path == root or path.startswith(root + "/") for path in paths if path for root in roots)


def name_os_thread(name: str | None = None) -> None:
    """Give the calling thread `name` (default: its Python name) as its kernel name, cut to 15 bytes, so that
    /proc/<pid>/task/<tid>/comm and `top -H` tell a worker's threads apart (Python before 3.14 names threads only for
    itself). Threads it starts later, OpenMP's among them, inherit the name. A no-op where /proc is missing."""
    text = (name or threading.current_thread().name).encode()[:15].decode(errors="ignore")
    try:
        (PROC / "self" / "task" / str(threading.get_native_id()) / "comm").write_text(text)
    except OSError:
        pass


def pids_matching(*fragments: str) -> list[int]:
    """Live processes (zombies excluded) whose command line contains every fragment, this process excluded."""
    me = os.getpid()
    found = []
    for stat in all_stats():
        if stat.pid != me and stat.running:
            line = cmdline(stat.pid)
            if line and all(f in line for f in fragments):
                found.append(stat.pid)
    return found


# --- process groups ------------------------------------------------------------------------------------


def group_members(pgid: int) -> list[int]:
    """Processes of the group that have not exited (zombies excluded)."""
    return [s.pid for s in all_stats() if s.pgid == pgid and s.running]


def group_alive(pgid: int) -> bool:
    """True while any process of the group has not exited."""
    return any(s.pgid == pgid and s.running for s in all_stats())


def signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to every process of the group; False when the group is already gone."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):  # gone, or its id now belongs to somebody else's group
        return False
    return True


def kill_group(pgid: int, grace_s: float = 10.0, kill_wait_s: float = 10.0) -> bool:
    """SIGTERM the group, SIGKILL whatever is left after `grace_s`, and wait until none of it runs.

    Returns True once the group is gone, False when processes still run `kill_wait_s` after SIGKILL (the kernel
    delivers it asynchronously; only a process stuck in the kernel outlives it). The caller still reaps its own
    child (Popen.wait) so no zombie stays behind.
    """
    return kill_groups([pgid], grace_s, kill_wait_s)


def kill_groups(pgids: Iterable[int], grace_s: float = 10.0, kill_wait_s: float = 10.0) -> bool:
    """`kill_group` for several groups at once: one grace period for all of them."""
    pgids = set(pgids)
    for pgid in pgids:
        signal_group(pgid, signal.SIGTERM)
    left = _wait_groups_gone(pgids, grace_s)
    if left:
        logger.warning("process groups %s ignored SIGTERM for %.0f s: SIGKILL", sorted(left), grace_s)
        for pgid in left:
            signal_group(pgid, signal.SIGKILL)
        left = _wait_groups_gone(left, kill_wait_s)
    if left:
        logger.error("process groups %s still have live processes %.0f s after SIGKILL", sorted(left), kill_wait_s)
    return not left


def _wait_groups_gone(pgids: set[int], timeout_s: float) -> set[int]:
    """The groups still alive after waiting up to `timeout_s` for all of them to go."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = {s.pgid for s in all_stats() if s.pgid in pgids and s.running}
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def group_cpu_seconds(pgid: int) -> float:
    """User plus system CPU seconds of the group's processes, zombies included (a reaped one no longer counts)."""
    ticks = sum(s.cpu_ticks for s in all_stats() if s.pgid == pgid)
    return ticks / os.sysconf("SC_CLK_TCK")


# --- memory --------------------------------------------------------------------------------------------


def status_kib(key: str, pid: int | str = "self") -> int:
    """A kB field of /proc/<pid>/status (VmRSS, VmHWM, ...); 0 when the process or the field is missing."""
    try:
        text = (PROC / str(pid) / "status").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith(key + ":"):
            parts = line.split()
            return int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else 0
    return 0


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of one process now (0 when it is gone)."""
    return status_kib("VmRSS", pid) * 1024


def descendants(pid: int) -> list[int]:
    """Children, grandchildren, ... of `pid` that have not exited (not `pid` itself)."""
    children: dict[int, list[int]] = {}
    for stat in all_stats():
        if stat.running:
            children.setdefault(stat.ppid, []).append(stat.pid)
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(children.get(child, []))
    return found


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of a process and all its descendants, summed (shared pages count once per process)."""
    return sum(rss_bytes(p) for p in [pid, *descendants(pid)])
