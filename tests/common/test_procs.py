"""common.procs against real processes: ports, stat parsing, process groups killed for good, memory and CPU reads."""
import os
import signal
import socket
import subprocess
import sys
import textwrap
import uuid

import pytest

from common import procs

# A group leader that starts a child (which starts a grandchild), prints the three pids, then sleeps.
FAMILY = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    if "--ignore-term" in sys.argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    grandchild = "import time; time.sleep(300)"
    child = subprocess.Popen([sys.executable, "-c",
        f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {grandchild!r}]); "
        "print(p.pid, flush=True); time.sleep(300)"], stdout=subprocess.PIPE, text=True)
    print(os.getpid(), child.pid, child.stdout.readline().strip(), flush=True)
    time.sleep(300)
""")


@pytest.fixture
def spawn():
    """Start a script as the leader of a new process group; every group started is killed at the end."""
    started = []

    def start(script: str, *args: str) -> tuple[subprocess.Popen, list[int]]:
        proc = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
        started.append(proc)
        return proc, [int(p) for p in proc.stdout.readline().split()]

    yield start
    for proc in started:
        procs.signal_group(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()


def test_free_port_is_free_to_bind():
    port = procs.free_port()
    assert 1024 <= port <= 65535
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # raises if something held it


def test_proc_stat_reads_this_process():
    stat = procs.proc_stat(os.getpid())
    assert (stat.pid, stat.ppid, stat.pgid, stat.state) == (os.getpid(), os.getppid(), os.getpgrp(), "R")
    assert stat.running and stat.cpu_ticks > 0


def test_a_command_name_with_spaces_and_parentheses_parses(tmp_path):
    odd = tmp_path / "we ird) (name"
    odd.symlink_to("/bin/sleep")
    proc = subprocess.Popen([str(odd), "300"])
    try:
        stat = procs.proc_stat(proc.pid)
        assert (stat.pid, stat.ppid, stat.state in "RSD") == (proc.pid, os.getpid(), True)  # D: still loading under load
    finally:
        proc.kill()
        proc.wait()


def test_an_exited_unreaped_child_is_a_zombie_not_alive():
    proc = subprocess.Popen(["true"])
    while procs.proc_stat(proc.pid).state != "Z":  # it exits at once; nobody reaps it until wait()
        os.sched_yield()
    assert not procs.alive(proc.pid) and procs.proc_stat(proc.pid).state == "Z"
    assert proc.pid not in procs.pids_matching("true")
    proc.wait()
    assert procs.proc_stat(proc.pid) is None and not procs.alive(proc.pid)


def test_pids_matching_finds_a_command_line_by_its_fragments(spawn):
    marker = f"marker-{uuid.uuid4().hex}"
    proc, _ = spawn("import time; print(0, flush=True); time.sleep(300)", marker, "second-arg")
    assert procs.pids_matching(marker) == [proc.pid]
    assert procs.pids_matching(marker, "second-arg") == [proc.pid]
    assert procs.pids_matching(marker, "absent-arg") == []
    assert procs.cmdline(proc.pid).endswith(f"{marker} second-arg")


def test_a_process_is_found_by_its_folder_its_environment_and_its_start(tmp_path):
    work, data = tmp_path / "work", tmp_path / "data"
    work.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", "import time; print(0, flush=True); time.sleep(300)",
                             f"--data={data}/x"], cwd=work, env={"MARK": "a=b"}, stdout=subprocess.PIPE, text=True)
    try:
        proc.stdout.readline()  # started: /proc shows its own environment and command line, not ours from the fork
        assert procs.cwd(proc.pid) == str(work) and procs.environ(proc.pid) == {"MARK": "a=b"}
        assert procs.names_folder(proc.pid, [work]) and procs.names_folder(proc.pid, [data])  # cwd, an option
        assert not procs.names_folder(proc.pid, [tmp_path / "wor"]) and not procs.names_folder(proc.pid, ["/nowhere"])
        assert procs.proc_stat(proc.pid).started >= procs.proc_stat(os.getpid()).started
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    assert procs.cwd(proc.pid) == "" and procs.environ(proc.pid) == {} and not procs.names_folder(proc.pid, [work])


def test_group_members_and_descendants_list_the_whole_family(spawn):
    proc, (leader, child, grandchild) = spawn(FAMILY)
    assert leader == proc.pid
    assert sorted(procs.group_members(leader)) == sorted([leader, child, grandchild])
    assert sorted(procs.descendants(leader)) == sorted([child, grandchild])
    assert procs.descendants(grandchild) == []
    assert procs.group_alive(leader)


def test_kill_group_terminates_a_cooperative_group_with_sigterm(spawn):
    proc, family = spawn(FAMILY)
    assert procs.kill_group(proc.pid, grace_s=30)
    assert proc.wait(timeout=5) == -signal.SIGTERM  # SIGTERM was enough: no SIGKILL needed
    assert not procs.group_alive(proc.pid) and not any(procs.alive(p) for p in family)


def test_kill_group_sigkills_a_group_that_ignores_sigterm(spawn):
    proc, family = spawn(FAMILY, "--ignore-term")
    assert procs.kill_group(proc.pid, grace_s=0.5)
    assert proc.wait(timeout=5) == -signal.SIGKILL
    assert procs.group_members(proc.pid) == [] and not any(procs.alive(p) for p in family)


def test_kill_groups_stops_several_groups_at_once(spawn):
    (first, _), (second, _) = spawn(FAMILY), spawn(FAMILY, "--ignore-term")
    assert procs.kill_groups([first.pid, second.pid], grace_s=0.5)
    assert (first.wait(timeout=5), second.wait(timeout=5)) == (-signal.SIGTERM, -signal.SIGKILL)


def test_a_group_that_is_gone_is_reported_gone():
    proc = subprocess.Popen(["true"], start_new_session=True)
    proc.wait()
    assert not procs.group_alive(proc.pid)
    assert procs.signal_group(proc.pid, signal.SIGTERM) is False
    assert procs.kill_group(proc.pid, grace_s=0.1) is True


def test_memory_reads_count_a_child_and_its_tree(spawn):
    hold = "import os, subprocess, sys, time; b = b'x' * (64 << 20); print(os.getpid(), flush=True); time.sleep(300)"
    parent, (pid,) = spawn(f"import subprocess, sys, time\n"
                           f"c = subprocess.Popen([sys.executable, '-c', {hold!r}], stdout=subprocess.PIPE, text=True)\n"
                           f"print(c.stdout.readline().strip(), flush=True)\ntime.sleep(300)\n")
    held = procs.rss_bytes(pid)
    assert held >= 64 << 20  # the 64 MiB of b'x' are written, so resident
    assert procs.tree_rss_bytes(parent.pid) >= held + procs.rss_bytes(parent.pid) > held
    assert procs.status_kib("VmHWM", pid) * 1024 >= held
    assert procs.status_kib("NoSuchField", pid) == 0
    assert procs.rss_bytes() == procs.status_kib("VmRSS") * 1024 > 0  # this process


def test_a_missing_process_reads_as_nothing():
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert procs.rss_bytes(gone.pid) == 0 and procs.cmdline(gone.pid) == "" and procs.descendants(gone.pid) == []


def test_group_cpu_seconds_adds_the_cpu_its_processes_used(spawn):
    burn = ("import os, time\nwhile time.process_time() < 0.3:\n    pass\n"
            "print(os.getpid(), flush=True)\ntime.sleep(300)\n")
    proc, _ = spawn(burn)
    assert procs.group_cpu_seconds(proc.pid) >= 0.3 - 0.02  # clock-tick rounding
    assert procs.group_cpu_seconds(proc.pid) == pytest.approx(procs.proc_stat(proc.pid).cpu_ticks
                                                              / os.sysconf("SC_CLK_TCK"))
