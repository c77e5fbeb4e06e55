"""A harness inside bubblewrap: what it may see, the launch argv, and the relay that gives it the proxy (and only
the proxy) over a Unix socket."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import tempfile
from pathlib import Path
from typing import AsyncIterator, Iterable
from urllib.parse import urlsplit

from django.conf import settings

from sandbox.isolation import (
    HARNESS_PIDS,
    HARNESS_TMP_BYTES,
    LAUNCHER,
    SOCKET_INSIDE,
    IsolationError,
    bwrap_base,
    check_visible,
    code_binds,
    code_inside,
    current,
    interpreter,
    python_dirs,
    real_path,
    within,
)
from sandbox.limits import PidsLimit, nproc_limit


def _loopback(base_url: str) -> tuple[str, int] | None:
    parts = urlsplit(base_url)
    host = parts.hostname or ""
    if host == "localhost":
        host = "127.0.0.1"
    try:
        port = parts.port
    except ValueError:
        return None
    return (host, port) if host.startswith("127.") and port else None


def harness_paths(argv: list[str], env_values: Iterable[str], workdir: Path, read_only: Iterable[str]) -> list[Path]:
    """The paths a harness is shown read-only: its declared ones and the folder of each existing file an absolute
    argv or env value names (IsolationError for one in a protected dir)."""
    shown = []
    for declared in read_only:
        if not os.path.isabs(declared):
            raise IsolationError(f"read-only path {declared!r} must be absolute")
        path = real_path(declared)
        check_visible(path, "read-only path")
        shown.append(path)
    for value in [*argv, *env_values]:
        if not value.startswith("/") or not os.path.isfile(value):
            continue
        folder = real_path(value).parent
        if within(folder, workdir):
            continue
        check_visible(real_path(value), "the file")
        check_visible(folder, "the folder")
        shown.append(folder)
    return shown


def resolve_program(program: str, path_env: str | None, cwd: Path) -> None:
    """FileNotFoundError (as exec would raise it) when the harness's program cannot be found outside."""
    if "/" in program:
        path = cwd / program  # an absolute program stays itself
        if not os.access(path, os.X_OK) or path.is_dir():
            raise FileNotFoundError(2, "No such file or directory", program)
    elif shutil.which(program, path=path_env) is None:
        raise FileNotFoundError(2, "No such file or directory", program)


@contextlib.asynccontextmanager
async def harness_sandbox(argv: list[str], env: dict[str, str], workdir: Path, read_only: Iterable[str],
                          base_url: str, disk_bytes: int) -> AsyncIterator[list[str]]:
    """The argv that runs the harness isolated (or as it is, unsafe), with the proxy relay listening while open.

    IsolationError when it may not run; the sandbox's cgroup is emptied and removed on the way out."""
    iso = current()
    if iso.bwrap is None:
        yield argv
        return
    workdir = real_path(workdir)
    entries = [(p, "ro") for p in python_dirs()]
    entries += [(p, "ro") for p in harness_paths(argv, env.values(), workdir, read_only)]
    entries += [(workdir, "rw")]
    target = _loopback(base_url)
    _remove_stale_relays()
    with tempfile.TemporaryDirectory(prefix=f"lw-relay-{os.getpid()}-") as sockets:
        socket_path = Path(sockets) / "proxy.sock"
        relay = _Relay(target) if target else None
        if relay is not None:
            await relay.start(socket_path)
        memory_mb = settings.LIGHTNING_HARNESS_MEMORY_MB
        pids = PidsLimit(HARNESS_PIDS, memory_mb=memory_mb)
        try:
            # Where no memory cgroup caps the sandbox, the address space does (a looser bound: it counts mappings).
            address_space = 0 if pids.memory_limited else memory_mb << 20
            inside = [interpreter(), "-I", "-B", code_inside(LAUNCHER),
                      "--listen", f"{target[0]}:{target[1]}" if target else "",
                      "--socket", SOCKET_INSIDE if target else "", "--fsize", str(disk_bytes),
                      "--nproc", str(nproc_limit(HARNESS_PIDS)), "--as", str(address_space), "--", *argv]
            binds = ["--bind", str(socket_path), SOCKET_INSIDE] if relay is not None else []
            binds += code_binds(LAUNCHER)
            sandbox = bwrap_base(iso, entries, HARNESS_TMP_BYTES, aliases=True)
            yield pids.wrap([*sandbox, *binds, "--chdir", str(workdir), "--", *inside])
        finally:  # no await here: a second cancel must not skip the clean-up
            pids.close()
            if relay is not None:
                relay.close()


@functools.lru_cache(maxsize=1)
def _remove_stale_relays() -> None:
    """Once per process: remove the relay socket folders of workers that died without cleaning up (SIGKILL)."""
    for path in Path(tempfile.gettempdir()).glob("lw-relay-*-*"):
        owner = path.name.split("-")[2]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            shutil.rmtree(path, ignore_errors=True)


class _Relay:
    """A unix socket server in the worker's loop that forwards each connection to the proxy's TCP port."""

    def __init__(self, target: tuple[str, int]):
        self.target, self.server, self.tasks = target, None, set()

    async def start(self, path: Path) -> None:
        self.server = await asyncio.start_unix_server(self._handle, path=str(path))

    def close(self) -> None:
        self.server.close()
        for task in list(self.tasks):
            task.cancel()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self.tasks.add(task)
        try:
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.target)
            except OSError:
                return
            try:
                await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
            finally:
                up_writer.close()
        finally:
            writer.close()
            self.tasks.discard(task)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        pass
