"""A PostgreSQL and a Redis of a test's own, started in temp dirs, that it may restart or stop at will.

The system's services are shared by every test session on the machine: a fault test never restarts those.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from common.procs import free_port

PG_BIN = Path(os.environ.get("LIGHTNING_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))


def _as_postgres(argv: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: run its tools as the postgres user when we are root."""
    return ["runuser", "-u", "postgres", "--"] + argv if os.geteuid() == 0 else argv


class OwnPostgres:
    """initdb + pg_ctl in a temp dir (trust auth, 127.0.0.1 on a free port); restart and stop as a fault would.

    The temp dir is a fresh one under /tmp, not pytest's (root's 0700 folders, which the postgres user cannot
    enter); `stop` deletes it."""

    def __init__(self):
        self.root = Path(tempfile.mkdtemp(prefix="lw-own-postgres-"))
        self.dir, self.port = self.root / "pgdata", free_port()
        self.log = self.root / "postgres.log"
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")

    @staticmethod
    def available() -> bool:
        return (PG_BIN / "initdb").exists() and (os.geteuid() != 0 or shutil.which("runuser") is not None)

    def _ctl(self, *args: str) -> None:
        opts = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.dir} -c fsync=off"
        subprocess.run(_as_postgres([str(PG_BIN / "pg_ctl"), "-D", str(self.dir), "-l", str(self.log), "-w",
                                     "-t", "60", "-o", opts, *args]), check=True, capture_output=True)

    def start(self) -> "OwnPostgres":
        subprocess.run(_as_postgres([str(PG_BIN / "initdb"), "-D", str(self.dir), "-U", "postgres",
                                     "--auth=trust", "-E", "UTF8", "--no-sync"]), check=True, capture_output=True)
        self._ctl("start")
        return self

    def restart(self) -> None:
        """A fast restart: every open connection is cut, the server is back a second or two later."""
        self._ctl("-m", "fast", "restart")

    def stop(self) -> None:
        if (self.dir / "postmaster.pid").exists():
            self._ctl("-m", "immediate", "stop")
        shutil.rmtree(self.root, ignore_errors=True)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""


class OwnRedis:
    """A redis-server on a free port with no persistence, as the embedded one: a restart loses every key."""

    def __init__(self, root: Path):
        self.root, self.port = root, free_port()
        self.proc: subprocess.Popen | None = None
        root.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "OwnRedis":
        import redis

        self.proc = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
             "--dir", str(self.root), "--save", "", "--appendonly", "no"],
            stdout=open(self.root / "redis.log", "ab"), stderr=subprocess.STDOUT, start_new_session=True)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 15
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start: {(self.root / 'redis.log').read_text()}")
                time.sleep(0.05)
        client.close()
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=15)

    def restart(self, down_s: float = 1.0) -> None:
        """Stop it (every key and group membership is gone), stay down `down_s`, start it on the same port."""
        self.stop()
        time.sleep(down_s)
        self.start()


def use_broker(app, url: str) -> str:
    """Point the Celery app's producers at `url`; returns the URL it had. The app forgets its pools (kombu keeps
    one per URL in its own registry: closing them would leave that registry holding closed pools)."""
    before = app.conf.broker_url
    app.conf.broker_url = url
    app._pool = None
    if "amqp" in app.__dict__:
        app.amqp._producer_pool = None
    return before
