"""Keeps `manage.py up`'s child processes running: one that dies is restarted after a growing delay, and said so.

A worker killed for memory must not take the web server down with it: its run is reclaimed by the sweep
(runs.durability) and resumes on the restarted worker.
"""
from __future__ import annotations

import logging
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable

from common.procs import kill_groups, signal_group

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Backoff:
    """Delay before the n-th restart in a row: first_s, doubling up to max_s; a child that stayed up reset_after_s
    starts over from first_s."""

    first_s: float = 1.0
    max_s: float = 60.0
    reset_after_s: float = 300.0

    def delay(self, restarts_in_a_row: int) -> float:
        return min(self.max_s, self.first_s * 2 ** restarts_in_a_row)


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    """Restarts in a row (reset once the child stays up for Backoff.reset_after_s)."""
    restart_at: float | None = None
    history: list[float] = field(default_factory=list)
    """Every delay this child waited before a restart, in order."""


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Supervisor:
    """Starts each child in a session of its own and restarts it whenever it dies, for as long as `run` runs.

    Deaths and restarts are told to `say` (`manage.py up` prints them with the children's own output).
    """

    def __init__(self, children: dict[str, list[str]], env: dict[str, str] | None = None,
                 backoff: Backoff = Backoff(), say: Callable[[str], None] = logger.warning,
                 clock: Callable[[], float] = time.monotonic):
        self.children = {name: Child(name, argv) for name, argv in children.items()}
        self.env, self.backoff, self.say, self.clock = env, backoff, say, clock

    def start(self) -> None:
        for child in self.children.values():
            self._launch(child)

    def pid(self, name: str) -> int | None:
        proc = self.children[name].proc
        return proc.pid if proc is not None else None

    def dead(self) -> list[Child]:
        """Children whose process has exited (and is not yet restarted)."""
        return [c for c in self.children.values() if c.proc is not None and c.proc.poll() is not None]

    def check(self) -> None:
        """One round: schedule a restart for each child that died, restart those whose delay is over."""
        now = self.clock()
        for child in self.children.values():
            if child.restart_at is None and child.proc is not None and child.proc.poll() is not None:
                self._schedule(child, now)
            elif child.restart_at is not None and now >= child.restart_at:
                child.restart_at = None
                self._launch(child)
                self.say(f"restarted the {child.name} (pid {child.proc.pid}; restart {len(child.history)})")

    def run(self, should_stop: Callable[[], bool], poll_s: float = 0.5) -> None:
        while not should_stop():
            self.check()
            time.sleep(poll_s)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every child's group, SIGKILL what is left after `grace_s`, and reap the children."""
        live = [c.proc for c in self.children.values() if c.proc is not None]
        kill_groups([proc.pid for proc in live], grace_s=grace_s)
        for proc in live:
            proc.wait()

    def _launch(self, child: Child) -> None:
        child.proc = subprocess.Popen(child.argv, env=self.env, start_new_session=True)
        child.started_at = self.clock()

    def _schedule(self, child: Child, now: float) -> None:
        # Whatever the dead child started in its session (a beat process, a grandchild) goes with it.
        signal_group(child.proc.pid, signal.SIGKILL)
        if now - child.started_at >= self.backoff.reset_after_s:
            child.restarts = 0
        delay = self.backoff.delay(child.restarts)
        child.restarts += 1
        child.history.append(delay)
        child.restart_at = now + delay
        message = (f"the {child.name} process {describe_exit(child.proc.returncode)}; restarting it in {delay:g} s "
                   f"(restart {len(child.history)})")
        self.say(message)

