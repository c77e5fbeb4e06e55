"""bench/run_profile.py's pure parts (bench/_cpu_ledger.py): /proc lines parsed, threads and children given their
parts, ticks split by phase with hand-computed totals, and the ratio arithmetic; one real read of this process."""
from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest

from bench._cpu_ledger import (TICKS_PER_S, Ledger, Snapshot, Stat, child_part, cpu_until, host_ticks, merged,
                               parse_stat, phase_label, read_snapshot, thread_part)
from bench.run_profile import busy_seconds, ratio, roof_tok_s
from common import procs

WORKER = 10
ENGINE, OLD_HARNESS, HARNESS = (20, 1), (21, 2), (22, 3)


def stat_line(pid: int, name: str, ppid: int, utime: int, stime: int, cutime: int, cstime: int, start: int) -> str:
    fields = ["S", ppid, pid, pid, 0, -1, 4194304, 0, 0, 0, 0, utime, stime, cutime, cstime, 20, 0, 1, 0, start]
    return f"{pid} ({name}) " + " ".join(map(str, fields + [0] * 32)) + "\n"


def test_parse_stat_reads_a_name_with_spaces_and_parentheses():
    line = stat_line(1234, "VLLM::Engine (x) y", 7, 11, 4, 30, 2, 998877)
    assert parse_stat(line) == Stat(1234, "VLLM::Engine (x) y", 7, 15, 998877)
    assert parse_stat("garbage") is None


def test_parse_stat_reads_this_process():
    with open(f"/proc/{os.getpid()}/stat") as handle:
        stat = parse_stat(handle.read())
    with open(f"/proc/{os.getpid()}/comm") as handle:
        name = handle.read().strip()
    assert (stat.pid, stat.name, stat.ppid) == (os.getpid(), name, os.getppid())
    assert stat.started == procs.proc_stat(os.getpid()).started and stat.own > 0


def test_host_ticks_splits_busy_idle_and_steal():
    text = "cpu  100 5 20 300 10 1 2 7 0 0\ncpu0 50 2 10 150 5 0 1 3 0 0\n"
    assert host_ticks(text) == Counter(busy=128, idle=310, steal=7)


@pytest.mark.parametrize("tid, name, part", [(WORKER, "celery", "worker"), (11, "proxy:8000", "proxy"),
                                             (12, "orm", "recorder"), (13, "trainer_0", "trainer"),
                                             (14, "python", "worker_other"), (15, "ThreadPoolExecu", "worker_other")])
def test_thread_part_goes_by_the_kernel_name(tid, name, part):
    assert thread_part(tid, WORKER, name) == part


@pytest.mark.parametrize("cmdlines, rollout, part", [
    (["/e/bin/python -m vllm.entrypoints.openai.api_server --model m", "VLLM::EngineCore"], None, "engine"),
    (["/bin/sh -c echo $$ > procs && exec \"$@\" sh bwrap -- python -I -B /lw/runner.py 5 6"], None, "reward"),
    (["bwrap --ro-bind / / -- python -I -B /lw/launcher.py --listen -- python agent.py"], None, "harness"),
    (["python agent.py"], 42, "harness"),  # unsandboxed: known by its rollout's proxy URL
    (["python -m celery -A lightning_web worker"], None, None),  # forked, not yet exec'd
    (["/usr/bin/nproc"], None, "children_other"),
    ([], None, None),
])
def test_child_part_goes_by_command_lines_and_rollout(cmdlines, rollout, part):
    assert child_part(cmdlines, rollout, "python -m celery -A lightning_web worker") == part


@pytest.mark.parametrize("phase, status, label", [
    ("starting the engine: compiling", "starting", "setup"), ("", "queued", "setup"),
    ("evaluating step 0: 12/40", "running", "eval 0"), ("evaluating step 3: 40/40", "running", "between"),
    ("step 2: generating rollouts", "running", "step 2"), ("step 2: syncing weights to the engine", "running", "step 2"),
    ("", "running", "between"),
])
def test_phase_label(phase, status, label):
    assert phase_label(phase, status) == label


def snapshot(at, phase, host, worker_own, threads, tree, kinds, rollouts, extra) -> Snapshot:
    names = {WORKER: "celery", 11: "proxy:8000", 12: "orm", 13: "trainer_0", 14: "python", 15: "python"}
    return Snapshot(at, phase, Counter(dict(zip(("busy", "idle", "steal"), host))),
                    Stat(WORKER, "celery", 1, worker_own, 0),
                    {tid: Stat(tid, names[tid], 1, own, 0) for tid, own in threads.items()},
                    tree, kinds, rollouts, extra)


def three_reads() -> Ledger:
    """Baseline; 10 s of evaluation (a thread ended, one started, a harness ended, another started); 5 s of a step.

    Processes: the engine (20) and its core (30); the old harness (21) and its agent (31); the new one (22, 32)."""
    kinds = {ENGINE: "engine", OLD_HARNESS: "harness", HARNESS: "harness"}
    ledger = Ledger()
    ledger.add(snapshot(0.0, "setup", (1000, 500, 0), 100, {WORKER: 60, 11: 20, 12: 10, 13: 5, 14: 5},
                        {(20, 1): (ENGINE, 10), (30, 5): (ENGINE, 40), (21, 2): (OLD_HARNESS, 1),
                         (31, 6): (OLD_HARNESS, 2)}, kinds, {OLD_HARNESS: 7}, {"profiler": 4, "redis": 2}))
    ledger.add(snapshot(10.0, "eval 0", (1300, 600, 20), 180, {WORKER: 90, 11: 40, 12: 20, 13: 5, 15: 12},
                        {(20, 1): (ENGINE, 20), (30, 5): (ENGINE, 130), (22, 3): (HARNESS, 1),
                         (32, 7): (HARNESS, 8)}, kinds, {HARNESS: 8}, {"profiler": 7, "redis": 3}))
    ledger.add(snapshot(15.0, "step 1", (1400, 600, 20), 230, {WORKER: 90, 11: 40, 12: 20, 13: 55, 15: 12},
                        {(20, 1): (ENGINE, 20), (30, 5): (ENGINE, 140), (22, 3): (HARNESS, 1),
                         (32, 7): (HARNESS, 18)}, kinds, {HARNESS: 8}, {"profiler": 7, "redis": 3}))
    return ledger


def test_the_ledger_splits_each_phase_into_parts_by_hand():
    seconds = three_reads().seconds()
    # What the old harness used after its last read is nowhere but in `other`, with the other users' time.
    eval_ticks = {"engine": 10 + 90, "harness": 1 + 8, "reward": 0, "children_other": 0, "worker": 30, "proxy": 20,
                  "recorder": 10, "trainer": 0, "worker_other": (80 - 72) + 12, "redis": 1, "profiler": 3,
                  "other": 300 - 193, "idle": 100, "steal": 20}
    step_ticks = {**dict.fromkeys(eval_ticks, 0), "engine": 10, "harness": 10, "trainer": 50, "other": 30}
    assert sorted(seconds) == ["eval 0", "step 1"]  # the baseline's phase has no interval of its own
    for phase, ticks, host, wall in (("eval 0", eval_ticks, 420, 10.0), ("step 1", step_ticks, 100, 5.0)):
        expected = {part: t / TICKS_PER_S for part, t in ticks.items()}
        assert seconds[phase] == pytest.approx({**expected, "host_s": host / TICKS_PER_S, "wall_s": wall})


def test_a_child_of_no_known_kind_counts_as_children_other():
    ledger = Ledger()
    unknown = (40, 9)
    ledger.add(snapshot(0.0, "eval 0", (0, 0, 0), 0, {}, {}, {}, {}, {}))
    ledger.add(snapshot(1.0, "eval 0", (10, 0, 0), 0, {}, {unknown: (unknown, 6)}, {}, {}, {}))
    assert ledger.seconds()["eval 0"]["children_other"] == pytest.approx(6 / TICKS_PER_S)


def test_harness_cpu_is_what_it_used_before_its_first_call_and_in_all():
    ledger = three_reads()
    # Rollout 7's harness was there at the baseline (0 ticks counted by 0.5 s); rollout 8's read 9 ticks by 10 s.
    startup, whole = ledger.harness_cpu({7: 0.5, 8: 12.0})
    assert (startup, whole) == pytest.approx((4.5 / TICKS_PER_S, 9.5 / TICKS_PER_S))  # medians of (0, 9), (0, 19)
    assert ledger.harness_cpu({7: 0.5, 8: 9.0})[0] == pytest.approx(0.0)  # 8's first read came after its call
    assert math.isnan(Ledger().harness_cpu({})[0])


def test_cpu_until_is_none_when_first_read_after_the_moment():
    timeline = [(10.0, 9), (15.0, 19)]
    assert (cpu_until(timeline, 9.9), cpu_until(timeline, 10.0), cpu_until(timeline, 99)) == (None, 9, 19)


def test_merged_adds_the_phases_of_one_kind():
    by_phase = {"eval 0": {"engine": 1.0, "host_s": 4.0}, "eval 1": {"engine": 2.0, "host_s": 6.0},
                "step 1": {"engine": 5.0, "host_s": 5.0}, "between": {"engine": 9.0, "host_s": 9.0}}
    assert merged(by_phase, "eval") == {"engine": 3.0, "host_s": 10.0}


def test_busy_seconds_is_the_length_of_the_union():
    assert busy_seconds([(5.0, 7.0), (0.0, 2.0), (1.0, 3.0), (6.0, 6.5)]) == pytest.approx(5.0)
    assert busy_seconds([]) == 0.0


def test_ratio_and_roof():
    assert ratio(50.0, 200.0) == 0.25
    assert math.isnan(ratio(1.0, 0.0))
    # 133 GFLOP/s over 2 x 134.5M FLOPs a token: the "roughly 490 tok/s".
    assert roof_tok_s(133.0, 134_515_008) == pytest.approx(494.4, abs=0.1)


def test_read_snapshot_sees_a_harness_child_and_a_named_thread_of_this_process():
    env = dict(os.environ, OPENAI_BASE_URL="http://127.0.0.1:9/rollouts/77/v1")
    burn = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\ntime.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", burn], env=env)
    stop, named = threading.Event(), threading.Event()

    def proxy_thread():
        procs.name_os_thread("proxy:9")
        named.set()
        stop.wait(30)

    thread = threading.Thread(target=proxy_thread)
    thread.start()
    try:
        named.wait(5)
        deadline = time.monotonic() + 10
        while procs.proc_stat(child.pid).cpu_ticks < 0.3 * TICKS_PER_S - 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        known: dict = {}
        snap = read_snapshot(os.getpid(), "eval 0", known, {"profiler": os.getpid()})
    finally:
        stop.set()
        thread.join()
        child.kill()
        child.wait()
    key = next(k for k in snap.tree if k[0] == child.pid)
    assert snap.tree[key][0] == key and snap.tree[key][1] >= 0.3 * TICKS_PER_S - 2  # clock-tick rounding
    assert snap.kinds[key] == "harness" and snap.rollouts[key] == 77 and known[key] == ("harness", 77)
    assert {thread_part(tid, os.getpid(), s.name) for tid, s in snap.threads.items()} >= {"worker", "proxy"}
    assert snap.phase == "eval 0" and snap.worker.pid == os.getpid() and snap.extra["profiler"] == snap.worker.own
    assert sum(snap.host.values()) > 0
