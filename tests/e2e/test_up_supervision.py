"""`manage.py up` supervises its children: a dead one is restarted with backoff and said so; the others stay up."""
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from common.procs import alive, free_port, signal_group
from lightning_web.supervisor import Backoff, Supervisor, describe_exit
from tests.e2e.test_up import ROOT, read_until

CRASH = [sys.executable, "-c", "import sys; sys.exit(3)"]
SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def supervisor():
    made = []

    def make(children, backoff=Backoff(first_s=1, max_s=4, reset_after_s=100)):
        said, clock = [], FakeClock()
        sup = Supervisor(children, backoff=backoff, say=said.append, clock=clock)
        made.append(sup)
        sup.start()
        return sup, said, clock

    yield make
    for sup in made:
        sup.stop(grace_s=5)


def crash_and_check(sup, name):
    """Wait for the child to exit for real, then let the supervisor see it."""
    sup.children[name].proc.wait(timeout=30)
    sup.check()


def test_a_child_that_keeps_dying_is_restarted_with_doubling_delays(supervisor):
    sup, said, clock = supervisor({"worker": CRASH, "web": SLEEP})
    web_pid = sup.pid("web")
    for _ in range(4):
        crash_and_check(sup, "worker")
        delay = sup.children["worker"].history[-1]
        clock.now += delay - 0.001
        sup.check()
        assert sup.children["worker"].restart_at is not None  # not before its delay is over
        clock.now += 0.001
        sup.check()
    assert sup.children["worker"].history == [1, 2, 4, 4]
    assert said[0] == "the worker process exited with code 3; restarting it in 1 s (restart 1)"
    assert re.fullmatch(r"restarted the worker \(pid \d+; restart 1\)", said[1])
    assert said[6] == "the worker process exited with code 3; restarting it in 4 s (restart 4)"
    assert sup.pid("web") == web_pid and sup.children["web"].proc.poll() is None  # the web server stays up
    assert sup.children["web"].history == []


def test_a_child_that_ran_long_enough_starts_over_from_the_first_delay(supervisor):
    sup, said, clock = supervisor({"worker": CRASH})
    crash_and_check(sup, "worker")
    clock.now += 1
    sup.check()  # restarted after 1 s
    clock.now += 150  # it stays up longer than reset_after_s before dying again
    crash_and_check(sup, "worker")
    assert sup.children["worker"].history == [1, 1]


def test_a_killed_child_is_reported_with_its_signal_and_its_group_goes_with_it(supervisor, tmp_path):
    pidfile = tmp_path / "grandchild"
    leader = ["sh", "-c", f"sleep 120 & echo $! > {pidfile}; wait"]
    sup, said, clock = supervisor({"worker": leader})
    deadline = time.monotonic() + 20
    while not (pidfile.exists() and pidfile.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.02)
    grandchild = int(pidfile.read_text())
    os.kill(sup.pid("worker"), signal.SIGKILL)  # like the kernel's OOM killer: the leader only
    crash_and_check(sup, "worker")
    assert said == ["the worker process was killed by SIGKILL (exit code -9); restarting it in 1 s (restart 1)"]
    deadline = time.monotonic() + 20
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not alive(grandchild)


def test_describe_exit():
    assert describe_exit(0) == "exited with code 0"
    assert describe_exit(-15) == "was killed by SIGTERM (exit code -15)"


@pytest.mark.e2e
@pytest.mark.slow
def test_up_restarts_a_killed_worker_and_the_web_server_stays_up(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY")}
    env.update(LIGHTNING_DATA_DIR=str(tmp_path / "data"), LIGHTNING_MODELS_DIR=str(tmp_path / "models"),
               PYTHONUNBUFFERED="1", LIGHTNING_SWEEP_EVERY_S="1")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "manage.py", "up", "--no-demo", "--port", str(port)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output = read_until(proc, r"lightning-web is running at", timeout=300)
        pids = dict(re.findall(r"(\w+) \(pid (\d+)\)", re.search(r"started (.*)", output).group(1)))
        assert set(pids) == {"web", "worker", "control"}
        token = re.search(r"API token of admin: (\w+)", output).group(1)
        # Both workers are ready before one is killed. The quiet console no longer prints beat's sweeps (every
        # LIGHTNING_SWEEP_EVERY_S=1 here): each worker's "ready" line, which may already be in `output`, says it.
        for name in ("runs", "control"):
            if not re.search(rf"{name}@\S+ ready", output):
                output += read_until(proc, rf"{name}@\S+ ready", timeout=120)
        os.kill(int(pids["worker"]), signal.SIGKILL)
        logged = read_until(proc, r"restarted the worker \(pid \d+; restart 1\)", timeout=60)
        assert "the worker process was killed by SIGKILL (exit code -9); restarting it in 1 s (restart 1)" in logged
        new_worker = int(re.search(r"restarted the worker \(pid (\d+)", logged).group(1))
        assert new_worker != int(pids["worker"]) and alive(new_worker) and alive(int(pids["web"]))
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base, timeout=30, headers={"Authorization": f"Token {token}"}) as http:
            assert http.get("/accounts/login/").status_code == 200  # the web server never went down
            run = _external_run(http)
            deadline, status = time.monotonic() + 120, "queued"
            while time.monotonic() < deadline and status in ("queued", "starting"):
                time.sleep(0.5)
                status = http.get(f"/api/v1/runs/{run}/").json()["status"]
            assert status == "failed"  # the restarted worker claimed it and refused it with a reason
    finally:
        signal_group(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        pidfile = tmp_path / "data" / "redis" / "redis.pid"
        if pidfile.exists():
            try:
                os.kill(int(pidfile.read_text()), signal.SIGTERM)
            except ProcessLookupError:
                pass
    assert proc.returncode == 0


def _external_run(http) -> int:
    harness = http.post("/api/v1/harnesses/", json={"name": "echo", "command": ["echo", "{task_file}"]}).json()
    dataset = http.post("/api/v1/datasets/", data={"name": "two", "val_ratio": "0"},
                        files={"file": ("t.jsonl", b'{"q": 1}\n{"q": 2}\n')}).json()
    reward = http.post("/api/v1/reward-scripts/",
                       json={"name": "zero", "source": "def reward(t, o):\n    return 0.0\n"})
    response = http.post("/api/v1/runs/", json={
        "name": "after-restart", "model": "http://127.0.0.1:9/v1", "config": {"steps": 1}, "harness": harness["id"],
        "dataset": dataset["id"], "reward_script": reward.json()["id"]})
    assert response.status_code == 201, response.text
    return response.json()["id"]
