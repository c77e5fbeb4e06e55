"""A test session or benchmark ends every process it starts (issue 40.12): real pytest sessions on the embedded Redis,
in lanes and in one process, leave no process of their data dir behind, however they end; a session that leaves one
fails; a benchmark that fails as it starts the app leaves nothing either."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.procs import all_stats, cmdline, environ, names_folder

ROOT = Path(__file__).resolve().parents[2]
USES_REDIS = """
import redis
from django.conf import settings

def test_it_talks_to_its_embedded_redis():
    port = (settings.DATA_DIR / "redis" / "port").read_text()
    assert settings.REDIS_URL.endswith(f"@127.0.0.1:{port}/0")
    assert redis.Redis.from_url(settings.REDIS_URL).ping()

def test_it_starts_a_process_as_torch_does():  # multiprocessing's resource tracker then lives as long as the session
    import multiprocessing
    child = multiprocessing.get_context("spawn").Process(target=print)
    child.start()
    child.join()
    assert child.exitcode == 0
"""
LEAVES_TWO = """
import os, subprocess, sys
from pathlib import Path

def test_it_leaves_two_processes_behind(tmp_path):
    sleep = [sys.executable, "-c", "import time; time.sleep(300)"]
    marked = subprocess.Popen(sleep, start_new_session=True)  # the session's mark in its environment
    bare = subprocess.Popen(sleep, env={}, cwd=tmp_path, start_new_session=True)  # no mark: in the session's folder
    Path(os.environ["PIDS_FILE"]).write_text(f"{marked.pid} {bare.pid}")
"""
KILLS_ITS_SESSION = """
import os, signal
from django.conf import settings

def test_it_ends_its_own_session():
    os.kill(os.getpid(), signal.{name})
"""


def session(tmp_path: Path, modules: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """A pytest session of this checkout (its pytest.ini: lanes, leftover check, Django) on the embedded Redis and a
    data dir of its own, running `modules` (name -> source)."""
    tests = tmp_path / "session"
    tests.mkdir()
    for name, source in modules.items():
        (tests / name).write_text(source)
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL") and not k.startswith("PYTEST_XDIST")}
    env.update(LIGHTNING_DATA_DIR=str(tmp_path / "data"), PIDS_FILE=str(tmp_path / "pids"))
    return subprocess.run([sys.executable, "-m", "pytest", "-c", str(ROOT / "pytest.ini"), "-q", "-p",
                           "no:cacheprovider", "--basetemp", str(tmp_path / "basetemp"), *args, str(tests)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def processes_of(folder: Path) -> list[int]:
    """Live processes that work in `folder`, name it on their command line, or have it as their data dir."""
    return [s.pid for s in all_stats() if s.running and s.pid != os.getpid()
            and (names_folder(s.pid, [folder]) or environ(s.pid).get("LIGHTNING_DATA_DIR", "").startswith(str(folder)))]


@pytest.fixture
def left_behind(tmp_path):
    """What still runs of the session's data dir and folders `within_s` after it ended (a Redis watcher looks once a
    second; multiprocessing's resource tracker leaves once its parent's pipe closes); ended at teardown."""

    def read(within_s: float = 5.0) -> list[str]:
        deadline = time.monotonic() + within_s
        while processes_of(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.1)
        return [f"{pid} {cmdline(pid)}" for pid in processes_of(tmp_path)]

    yield read
    for pid in processes_of(tmp_path):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("lanes", [["-n", "2", "--dist", "loadfile"], []], ids=["two-lanes", "one-process"])
def test_a_session_on_the_embedded_redis_leaves_no_process_behind(tmp_path, left_behind, lanes):
    done = session(tmp_path, {"test_a.py": USES_REDIS, "test_b.py": USES_REDIS}, *lanes)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "4 passed" in done.stdout
    started = sorted(str(p.parent.parent.relative_to(tmp_path)) for p in tmp_path.glob("data/**/redis/redis.log"))
    assert started == (["data", "data/lanes/gw0", "data/lanes/gw1"] if lanes else ["data"])  # no lane in a lane
    assert left_behind() == []


@pytest.mark.parametrize("lanes", [["-n", "2"], []], ids=["a-lane", "one-process"])
def test_a_session_that_leaves_a_process_behind_fails_and_ends_it(tmp_path, left_behind, lanes):
    done = session(tmp_path, {"test_leaves.py": LEAVES_TWO}, *lanes)
    pids = (tmp_path / "pids").read_text().split()
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "1 passed" in done.stdout
    assert "FAILED: 2 processes of this test session still ran at its end" in done.stdout
    listed = [line.split()[0] for line in done.stdout.splitlines() if "time.sleep(300)" in line]
    assert sorted(listed) == sorted(pids)
    assert left_behind() == []


@pytest.mark.parametrize("name", ["SIGTERM", "SIGKILL"])
def test_a_session_killed_in_a_test_takes_its_embedded_redis_with_it(tmp_path, left_behind, name):
    done = session(tmp_path, {"test_kills.py": KILLS_ITS_SESSION.format(name=name)})
    exit_code = {"SIGTERM": pytest.ExitCode.INTERRUPTED, "SIGKILL": -signal.SIGKILL}[name]
    assert done.returncode == exit_code, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "data" / "redis" / "redis.log").exists()  # it had started one
    # SIGTERM: ends as an interrupted session, with its check; SIGKILL: the Redis watcher sees its owner gone
    assert left_behind() == []


def test_a_bench_that_fails_as_it_starts_the_app_leaves_no_process_behind(tmp_path, left_behind):
    """bench/step_overhead.py on a fresh data dir whose settings fail after the embedded Redis started (here a bad
    setting; on a fresh clone, a missing engine venv or model import fails a moment later)."""
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL")}
    env["LIGHTNING_LOGIN_FAILURE_LIMIT"] = "0"
    done = subprocess.run([sys.executable, "bench/step_overhead.py", "--steps", "2",
                           "--data-dir", str(tmp_path / "data"), "--models-dir", str(tmp_path / "models")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "LIGHTNING_LOGIN_FAILURE_LIMIT" in done.stderr, done.stderr[-3000:]
    assert (tmp_path / "data" / "redis" / "redis.log").exists()  # it had started the app's Redis
    assert left_behind() == []
