"""The embedded Redis of a data dir: started once, shared, password-protected on loopback, and stopped on request."""
import shutil
import stat
import time
from pathlib import Path

import pytest
import redis

from common.procs import alive
from lightning_web import embedded_redis


def test_it_starts_one_redis_per_data_dir_and_stop_ends_it(tmp_path):
    url = embedded_redis.ensure_running(tmp_path)
    port = int((tmp_path / "redis" / "port").read_text())
    pid = int((tmp_path / "redis" / "redis.pid").read_text())
    secret = (tmp_path / "redis" / "password").read_text().strip()
    assert url == f"redis://:{secret}@127.0.0.1:{port}/0" and embedded_redis._ping(port, secret)
    assert embedded_redis.ensure_running(tmp_path) == url  # the second caller shares it

    assert embedded_redis.stop(tmp_path) is True
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid) and not embedded_redis._ping(port, secret)


@pytest.fixture
def server(tmp_path):
    url = embedded_redis.ensure_running(tmp_path)
    yield url, int((tmp_path / "redis" / "port").read_text()), (tmp_path / "redis" / "password").read_text().strip()
    embedded_redis.stop(tmp_path)


def test_a_client_without_the_password_is_refused(server):
    url, port, secret = server
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:  # a raw client: the server's own answer
        conn.sendall(b"SET k stolen\r\nAUTH wrong\r\n")
        reply = b""
        while reply.count(b"\r\n") < 2:
            reply += conn.recv(256)
    assert reply.startswith(b"-NOAUTH Authentication required.\r\n") and b"-WRONGPASS" in reply
    for client in (redis.Redis(port=port), redis.Redis(port=port, password="wrong" + secret)):
        with pytest.raises(redis.AuthenticationError):
            client.set("k", "stolen")
        client.close()
    with redis.Redis.from_url(url) as client:  # the URL the app's clients use carries it
        assert client.get("k") is None  # nothing got written without the password
        assert client.set("k", "v") and client.get("k") == b"v"
        assert client.config_get("requirepass") == {"requirepass": secret}


def test_it_listens_on_loopback_only_in_protected_mode(server):
    url, port, _ = server
    with redis.Redis.from_url(url) as client:
        assert client.config_get("bind") == {"bind": "127.0.0.1 -::1"}
        assert client.config_get("protected-mode") == {"protected-mode": "yes"}
    listening = {line.split()[1] for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
                 if line.split()[3] == "0A" and int(line.split()[1].split(":")[1], 16) == port}
    assert listening == {f"0100007F:{port:04X}"}  # 127.0.0.1 only (IPv4): no 0.0.0.0 or other address


def test_the_password_is_generated_once_and_kept_private(tmp_path, server):
    url, port, secret = server
    key = tmp_path / "redis" / "password"
    assert len(secret) >= 40 and stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "redis").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "redis" / "redis.conf").stat().st_mode) == 0o600
    assert embedded_redis.password(tmp_path) == secret and embedded_redis.ensure_running(tmp_path) == url
    pid = int((tmp_path / "redis" / "redis.pid").read_text())
    assert secret not in Path(f"/proc/{pid}/cmdline").read_text()  # not in the process list
    assert secret not in (tmp_path / "redis" / "redis.log").read_text()
    assert embedded_redis.password(tmp_path / "other") != secret  # another data dir, another password


@pytest.mark.parametrize("url, shown", [
    ("redis://:s3cret-_x@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
    ("rediss://user:pw@host:1/2", "rediss://user:***@host:1/2"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("postgres://postgres@127.0.0.1:5432/db", "postgres://postgres@127.0.0.1:5432/db"),
])
def test_redacted_hides_the_password_of_a_url(url, shown):
    assert embedded_redis.redacted(url) == shown


def test_an_older_server_without_a_password_is_replaced(tmp_path):
    """A data dir's redis-server started before passwords existed is stopped and a protected one takes over."""
    import subprocess

    from common.procs import free_port

    state = tmp_path / "redis"
    state.mkdir()
    old_port = free_port()
    subprocess.run([embedded_redis._executable(), "--port", str(old_port), "--bind", "127.0.0.1", "--daemonize", "yes",
                    "--pidfile", str(state / "redis.pid"), "--dir", str(state), "--save", ""], check=True)
    deadline = time.monotonic() + 10
    while not embedded_redis._ping(old_port, None) and time.monotonic() < deadline:
        time.sleep(0.05)
    old_pid = int((state / "redis.pid").read_text())
    (state / "port").write_text(str(old_port))
    try:
        url = embedded_redis.ensure_running(tmp_path)
        assert ":***@" in embedded_redis.redacted(url) and f":{old_port}/" not in url
        deadline = time.monotonic() + 10
        while alive(old_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(old_pid)
        with redis.Redis.from_url(url) as client:
            assert client.ping() is True
    finally:
        embedded_redis.stop(tmp_path)
        if alive(old_pid):
            import os
            import signal
            os.kill(old_pid, signal.SIGTERM)


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


def _started_watchers(state, timeout_s=10.0) -> list[int]:
    """The watchers of `state` once one shows (Popen returns before the child has exec'd into the watcher)."""
    deadline = time.monotonic() + timeout_s
    while not _watchers(state) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _watchers(state)


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
    watchers = _started_watchers(data / "redis")
    assert len(watchers) == 1 and alive(pid)

    shutil.rmtree(data)

    assert _gone([pid, *watchers]) and not embedded_redis._ping(port, None)


def test_the_watcher_leaves_when_its_redis_is_stopped(tmp_path):
    embedded_redis.ensure_running(tmp_path)
    watchers = _started_watchers(tmp_path / "redis")
    assert len(watchers) == 1
    embedded_redis.stop(tmp_path)
    assert _gone(watchers) and (tmp_path / "redis").exists()


def test_a_redis_started_for_an_owner_ends_with_it_and_only_the_owner_stops_it(tmp_path):
    """A test session or benchmark (LIGHTNING_EMBEDDED_REDIS_OWNER) takes its Redis with it however it ends."""
    import signal
    import subprocess
    import sys

    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        url = embedded_redis.ensure_running(tmp_path, owner=owner.pid)
        pid = int((tmp_path / "redis" / "redis.pid").read_text())
        watchers = _started_watchers(tmp_path / "redis")
        assert embedded_redis.stop(tmp_path, owner=owner.pid + 1) is False and alive(pid)  # not that one's to stop
        assert embedded_redis.ensure_running(tmp_path) == url  # shared as it is
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        assert _gone([pid, *watchers], timeout_s=5)  # the watcher looks once a second
        assert (tmp_path / "redis").exists()
    finally:
        owner.kill()
        owner.wait()
        embedded_redis.stop(tmp_path)
