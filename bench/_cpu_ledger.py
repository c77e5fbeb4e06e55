"""CPU time per part of a run, from reads of /proc: parsing, attribution to parts and phases (bench/run_profile.py).

The parts, ticks of the host's CPU time:
- the run worker's threads, by the kernel names the code gives them (common.procs.name_os_thread): `worker` its
  main thread (the run's event loop: orchestrator, harness launches, the harnesses' socket relay), `proxy` the
  proxy's thread, `recorder` the ORM thread (the recorder's batched writes, and the run's other ORM calls),
  `trainer` the trainer thread and the OpenMP threads it started, `worker_other` the rest (Celery's, asyncio's
  executor, threads that ended between two reads);
- the worker's children, each with its descendants: `engine` (vLLM), `harness` (sh, bubblewrap, launcher, agent:
  the processes that carry a rollout's proxy URL), `reward` (the reward runner), `children_other` children of no
  known kind;
- named processes outside the worker's tree (`redis`, `profiler`), `other` the rest of the host's busy time (other
  users, the kernel, and what the parts' processes used after their last read), `idle` (with iowait) and `steal`,
  from /proc/stat.
A process counts with its own utime + stime as last read: children's reaped times (cutime, cstime) cannot be used,
because bubblewrap does not hand its sandbox's CPU time back (a child burning 0.5 s inside bwrap added 0.0 s to
its parent's children times). So the children's parts are lower bounds: what a process used after its last read,
and a process that lived less than one interval, land in `other`.
Each read's increments go to the run's phase at that moment: `setup` (until the engine is up), `eval N` (until its
last attempt is done), `step N`, and `between` (the policy's load, what follows an evaluation, the run's end).
"""
from __future__ import annotations

import math
import os
import re
import statistics
import time
from collections import Counter, defaultdict
from dataclasses import dataclass

from common import procs

TICKS_PER_S = os.sysconf("SC_CLK_TCK")
PARTS = ("engine", "harness", "reward", "children_other", "worker", "proxy", "recorder", "trainer", "worker_other",
         "redis", "profiler", "other", "idle", "steal")
HOST_FIELDS = ("busy", "idle", "steal")
ROLLOUT_URL = re.compile(r"/rollouts/(\d+)/")

Proc = tuple[int, int]
"""A process: (pid, start time in ticks after boot), which a reused pid does not repeat."""
Child = Proc
"""A child of the worker, standing for its descendants too."""


@dataclass(frozen=True)
class Stat:
    """The fields of a /proc/<pid>/stat or /proc/<pid>/task/<tid>/stat line this bench reads (CPU in clock ticks)."""

    pid: int
    name: str
    ppid: int
    own: int
    """utime + stime: CPU the process (or thread) used itself."""
    started: int


def parse_stat(text: str) -> Stat | None:
    """A stat line parsed (the name, in parentheses, may hold spaces and ')'), or None when it is not one."""
    head, _, rest = text.rpartition(")")
    pid, _, name = head.partition(" (")
    fields = rest.split()
    try:
        return Stat(int(pid), name, int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[19]))
    except (IndexError, ValueError):
        return None


def host_ticks(text: str) -> Counter:
    """busy, idle (idle + iowait) and steal ticks of all CPUs from /proc/stat (guest time is inside user)."""
    values = [int(v) for v in text.split("\n", 1)[0].split()[1:9]] + [0] * 8
    user, nice, system, idle, iowait, irq, softirq, steal = values[:8]
    return Counter(busy=user + nice + system + irq + softirq, idle=idle + iowait, steal=steal)


def thread_part(tid: int, pid: int, name: str) -> str:
    """The part one of the worker's threads belongs to, by its kernel name."""
    if tid == pid:
        return "worker"
    if name.startswith("proxy:"):
        return "proxy"
    if name == "orm":
        return "recorder"
    return "trainer" if name.startswith("trainer") else "worker_other"


def child_part(cmdlines: list[str], rollout: int | None, worker_cmdline: str) -> str | None:
    """The part of a worker's child (with its descendants' command lines), or None while it is not known yet: a
    child forked and not yet exec'd still shows the worker's command line."""
    text = " ".join(cmdlines)
    if "vllm" in text.lower():
        return "engine"
    if "runner.py" in text:
        return "reward"
    if rollout is not None or "launcher.py" in text:
        return "harness"
    return None if not cmdlines or cmdlines[0] == worker_cmdline else "children_other"


def phase_label(phase: str, status: str) -> str:
    """The window a read belongs to, from the run's phase column and status."""
    if status in ("queued", "starting"):
        return "setup"
    evaluating = re.match(r"evaluating step (\d+): (\d+)/(\d+)", phase)
    if evaluating:
        return f"eval {evaluating[1]}" if evaluating[2] != evaluating[3] else "between"
    stepping = re.match(r"step (\d+):", phase)
    return f"step {stepping[1]}" if stepping else "between"


@dataclass
class Snapshot:
    """One read of /proc: the CPU ticks so far of each part's processes and threads, and the run's phase then."""

    at: float
    phase: str
    host: Counter
    worker: Stat
    threads: dict[int, Stat]
    tree: dict[Proc, tuple[Child, int]]
    """Each process below the worker: the worker's child it descends from, and its own ticks."""
    kinds: dict[Child, str]
    rollouts: dict[Child, int]
    extra: dict[str, int]
    """Ticks of processes outside the worker's tree: the profiler (this process), redis."""


class Ledger:
    """Ticks per phase and part from consecutive snapshots. A child's ticks stay its own until the end, when its
    part (read once it had exec'd) is known."""

    def __init__(self):
        self.ticks: dict[str, Counter] = defaultdict(Counter)
        self.host: dict[str, Counter] = defaultdict(Counter)
        self.wall: Counter = Counter()
        self.child_ticks: dict[Child, Counter] = defaultdict(Counter)
        self.child_total: Counter = Counter()
        self.kinds: dict[Child, str] = {}
        self.rollouts: dict[Child, int] = {}
        self.timeline: dict[Child, list[tuple[float, int]]] = defaultdict(list)
        self.last: Snapshot | None = None

    def add(self, snap: Snapshot) -> None:
        prev, self.last = self.last, snap
        self.kinds.update(snap.kinds)
        self.rollouts.update(snap.rollouts)
        if prev is not None:  # else the baseline
            self._add_interval(prev, snap)
        for child in {child for child, _ in snap.tree.values()}:
            self.timeline[child].append((snap.at, self.child_total[child]))

    def _add_interval(self, prev: Snapshot, snap: Snapshot) -> None:
        phase, ticks = snap.phase, self.ticks[snap.phase]
        self.wall[phase] += snap.at - prev.at
        self.host[phase].update({k: snap.host[k] - prev.host[k] for k in HOST_FIELDS})
        in_threads = 0
        for tid, stat in snap.threads.items():
            used = stat.own - (prev.threads[tid].own if tid in prev.threads else 0)
            ticks[thread_part(tid, snap.worker.pid, stat.name)] += used
            in_threads += used
        ticks["worker_other"] += snap.worker.own - prev.worker.own - in_threads  # threads that ended
        for proc, (child, own) in snap.tree.items():  # a process new since the last read: all it used
            used = own - (prev.tree[proc][1] if proc in prev.tree else 0)
            self.child_ticks[child][phase] += used
            self.child_total[child] += used
        for name, value in snap.extra.items():
            ticks[name] += value - prev.extra.get(name, value)

    def harness_cpu(self, first_call: dict[int, float]) -> tuple[float, float]:
        """Medians over the harnesses read of the CPU seconds each used before its rollout's first call entered the
        proxy (`first_call`: rollout id -> time), and in all (nan when none was read in time)."""
        startup, whole = [], []
        for child, rollout in self.rollouts.items():
            timeline = self.timeline[child]
            before = cpu_until(timeline, first_call.get(rollout, -math.inf))
            if before is not None:
                startup.append(before / TICKS_PER_S)
            whole.append(timeline[-1][1] / TICKS_PER_S)
        return _median(startup), _median(whole)

    def seconds(self) -> dict[str, dict[str, float]]:
        """{phase: {part: CPU seconds}} with `other`, `idle`, `steal`, the capacity (`host_s`) and `wall_s`."""
        out = {}
        for phase, ticks in self.ticks.items():
            parts = Counter(ticks)
            for child, by_phase in self.child_ticks.items():
                parts[self.kinds.get(child, "children_other")] += by_phase[phase]
            host = self.host[phase]
            parts.update(other=host["busy"] - sum(parts.values()), idle=host["idle"], steal=host["steal"])
            out[phase] = {part: parts[part] / TICKS_PER_S for part in PARTS}
            out[phase].update(host_s=sum(host.values()) / TICKS_PER_S, wall_s=self.wall[phase])
        return out


def merged(by_phase: dict[str, dict[str, float]], prefix: str) -> dict[str, float]:
    """The sum over the phases named `prefix N`."""
    total: Counter = Counter()
    for phase, values in by_phase.items():
        if phase.startswith(prefix + " "):
            total.update(values)
    return dict(total)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def cpu_until(timeline: list[tuple[float, int]], moment: float) -> int | None:
    """A child's ticks at its last read at or before `moment`; None when it was first read after it."""
    before = [ticks for at, ticks in timeline if at <= moment]
    return before[-1] if before else None


# ---- reading /proc ----------------------------------------------------------------------------------------

def read_stat(path: str) -> Stat | None:
    try:
        with open(path) as handle:
            return parse_stat(handle.read())
    except OSError:
        return None


def read_snapshot(worker_pid: int, phase: str, known: dict[Child, tuple[str, int | None]],
                  extra_pids: dict[str, int]) -> Snapshot | None:
    """One read (None once the worker is gone); `known` keeps each child's (kind, rollout) once they are read."""
    stats = {s.pid: s for s in map(read_stat, (f"/proc/{pid}/stat" for pid in procs.pids())) if s}
    worker = stats.get(worker_pid)
    if worker is None:
        return None
    threads = {s.pid: s for s in (read_stat(f"/proc/{worker_pid}/task/{tid}/stat")
                                  for tid in _listdir(f"/proc/{worker_pid}/task")) if s}
    below: dict[int, list[int]] = defaultdict(list)
    for stat in stats.values():
        below[stat.ppid].append(stat.pid)
    tree, children = {}, set()
    for pid in below[worker_pid]:
        members = _tree(pid, below)
        child = (pid, stats[pid].started)
        children.add(child)
        tree.update({(m, stats[m].started): (child, stats[m].own) for m in members})
        if child not in known and (found := _kind(members, procs.cmdline(worker_pid))) is not None:
            known[child] = found
    kinds = {child: known[child][0] for child in children if child in known}
    rollouts = {child: known[child][1] for child in kinds if known[child][1] is not None}
    extra = {name: stats[pid].own for name, pid in extra_pids.items() if pid in stats}
    with open("/proc/stat") as handle:
        host = host_ticks(handle.read())
    return Snapshot(time.time(), phase, host, worker, threads, tree, kinds, rollouts, extra)


def _tree(pid: int, below: dict[int, list[int]]) -> list[int]:
    members, todo = [], [pid]
    while todo:
        members.append(todo.pop())
        todo.extend(below[members[-1]])
    return members


def _kind(members: list[int], worker_cmdline: str) -> tuple[str, int | None] | None:
    """(part, rollout id) of a worker's child from its processes' command lines and its environment."""
    found = ROLLOUT_URL.search(procs.environ(members[0]).get("OPENAI_BASE_URL", ""))
    rollout = int(found[1]) if found else None
    kind = child_part([procs.cmdline(m) for m in members], rollout, worker_cmdline)
    return None if kind is None else (kind, rollout)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []
