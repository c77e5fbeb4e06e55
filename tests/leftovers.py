"""A pytest plugin (pytest.ini loads it with `-p`, before Django starts): a test session leaves no process behind.

Every process a session starts carries the session's mark in its environment (LIGHTNING_TEST_SESSION; a session
started inside it extends the mark), and the embedded Redis its settings start is owned by the session's process
(LIGHTNING_EMBEDDED_REDIS_OWNER): the server and its watcher end with that process however it ends
(lightning_web/embedded_redis.py). When the session finishes it stops that Redis and gives the rest a moment to go;
what still runs then is listed, ended, and fails the run: a process with the mark, or one started since the session
began that works in or names the session's temporary folder or its lane's data dir (a harness sandbox whose
environment was cleared). A lane tells the controller what it found, so a leftover in any lane fails the run.
SIGTERM ends a session as Ctrl-C does: fixtures are torn down and the check runs.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from common.procs import alive, all_stats, cmdline, environ, names_folder
from tests.lanes import ROOT, lane

SESSION_ENV = "LIGHTNING_TEST_SESSION"
OWNER_ENV = "LIGHTNING_EMBEDDED_REDIS_OWNER"
GRACE_S = 10.0
"""How long a finished session's processes have to go (a Redis watcher looks once a second)."""
OUTPUT_KEY = "leftover_processes"
"""Where a lane puts what it found in the report pytest-xdist sends its controller (`workeroutput`)."""

MARK = f"{os.environ.get(SESSION_ENV, '')}/{os.getpid()}"
"""This session's mark: its parent session's mark (if any), then its own pid."""
BEFORE = frozenset((stat.pid, stat.started) for stat in all_stats())
"""The processes that ran before this session began: never its own."""
temp_folders: list[Path] = []
"""The session's temporary folder, once a test has asked for it."""
found_in_lanes: list[str] = []
HELPERS = ("from multiprocessing.resource_tracker import main", "from multiprocessing.forkserver import main")
"""Command lines of the helpers multiprocessing starts for a process (torch's too): they read a pipe from it and end
when it does, so a session's own are not left behind."""


def _mark_this_session() -> None:
    os.environ[SESSION_ENV] = MARK
    os.environ[OWNER_ENV] = str(os.getpid())
    try:
        signal.signal(signal.SIGTERM, _interrupt)
    except ValueError:  # not the main thread: the embedded Redis still ends with the process
        pass


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


_mark_this_session()  # at import: before the settings start the embedded Redis


def is_marked(mark: str, session: str) -> bool:
    """True when `session` (a process's LIGHTNING_TEST_SESSION) is the session `mark` or one started inside it."""
    return session == mark or session.startswith(mark + "/")


def own_folders() -> list[Path]:
    """The folders no other session uses: the temporary one, and a lane's data dir (a plain session's may be the
    app's own, shared with `./lw up`)."""
    return [*temp_folders, *([data_dir()] if lane() is not None else [])]


def own_processes(mark: str = MARK, folders=None, before=BEFORE) -> list[int]:
    """The live processes of the session `mark`: marked, or new since `before` and naming one of its folders."""
    folders = own_folders() if folders is None else folders
    found = []
    for stat in all_stats():
        if stat.pid == os.getpid() or not stat.running or (stat.pid, stat.started) in before:
            continue
        if stat.ppid == os.getpid() and any(helper in cmdline(stat.pid) for helper in HELPERS):
            continue
        if is_marked(mark, environ(stat.pid).get(SESSION_ENV, "")) or names_folder(stat.pid, folders):
            found.append(stat.pid)
    return found


def end(pids: list[int], grace_s: float = 5.0) -> None:
    """SIGTERM each process, then SIGKILL what is left after `grace_s`."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, grace_s)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:  # gone already
                pass
        deadline = time.monotonic() + wait_s
        while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)


def leftovers(grace_s: float = GRACE_S) -> list[str]:
    """After stopping this session's embedded Redis: 'pid command line' of each of its processes still running
    `grace_s` later. They are ended before this returns."""
    from lightning_web import embedded_redis

    embedded_redis.stop(data_dir(), wait_s=grace_s, owner=os.getpid())
    deadline = time.monotonic() + grace_s
    while (pids := own_processes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = [f"{pid} {cmdline(pid)[:300]}" for pid in pids]
    end(pids)
    return lines


def data_dir() -> Path:
    """The session's data dir as the settings read it (a lane's own: tests/lanes.py)."""
    return Path(os.environ.get("LIGHTNING_DATA_DIR") or ROOT / "data").expanduser().resolve()


@pytest.fixture(scope="session", autouse=True)
def _session_temp_folder(tmp_path_factory):
    """The session's temporary folder (each lane's own), where tests start engines, workers and harnesses."""
    temp_folders.append(tmp_path_factory.getbasetemp().resolve())


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """On the controller: what a lane found at its end."""
    found_in_lanes.extend(getattr(node, "workeroutput", {}).get(OUTPUT_KEY, []))


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    """After the fixtures and the lanes are done: fail the run for every process of it still running."""
    lines = found_in_lanes + leftovers()
    if not lines:
        return
    if hasattr(session.config, "workeroutput"):  # a lane: its controller reports it and fails the run
        session.config.workeroutput[OUTPUT_KEY] = lines
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"FAILED: {len(lines)} processes of this test session still ran at its end "
                            "(ended now; every process a test starts must end with it):", red=True)
        for line in lines:
            reporter.write_line(f"  {line}")
