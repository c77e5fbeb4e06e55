"""The embedded Redis of a data dir: started once, shared, and stopped on request."""
import time

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
