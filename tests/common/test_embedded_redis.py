"""The embedded Redis of a data dir: started once, shared, and stopped on request."""
import shutil
import time
from pathlib import Path

from common.procs import alive
from lightning_web import embedded_redis


def test_it_starts_one_redis_per_data_dir_and_stop_ends_it(tmp_path):
    url = embedded_redis.ensure_running(tmp_path)
    port = int((tmp_path / "redis" / "port").read_text())
    pid = int((tmp_path / "redis" / "redis.pid").read_text())
    assert url == f"redis://127.0.0.1:{port}/0" and embedded_redis._ping(port)
    assert embedded_redis.ensure_running(tmp_path) == url  # the second caller shares it

    assert embedded_redis.stop(tmp_path) is True
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid) and not embedded_redis._ping(port)


def test_stop_without_a_redis_says_so(tmp_path):
    assert embedded_redis.stop(tmp_path) is False
    (tmp_path / "redis").mkdir()
    (tmp_path / "redis" / "redis.pid").write_text("not a pid")
    assert embedded_redis.stop(tmp_path) is False


def _watchers(state) -> list[int]:
    """Pids of the watcher processes of a state folder (python lightning_web/embedded_redis.py <state>)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"embedded_redis.py") for a in argv) and str(state).encode() in argv:
            found.append(int(proc.name))
    return found


def _gone(pids, timeout_s=15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(alive(pid) for pid in pids)


def test_a_deleted_data_dir_takes_its_redis_and_watcher_with_it(tmp_path):
    data = tmp_path / "throwaway"
    embedded_redis.ensure_running(data)
    port = int((data / "redis" / "port").read_text())
    pid = int((data / "redis" / "redis.pid").read_text())
    watchers = _watchers(data / "redis")
    assert len(watchers) == 1 and alive(pid)

    shutil.rmtree(data)

    assert _gone([pid, *watchers]) and not embedded_redis._ping(port)


def test_the_watcher_leaves_when_its_redis_is_stopped(tmp_path):
    embedded_redis.ensure_running(tmp_path)
    watchers = _watchers(tmp_path / "redis")
    assert len(watchers) == 1
    embedded_redis.stop(tmp_path)
    assert _gone(watchers) and (tmp_path / "redis").exists()
