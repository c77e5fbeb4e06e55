"""The README's first command on a fresh data dir: embedded SQLite and Redis, web + worker, a first user."""
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from common.procs import alive, free_port, pids_matching, signal_group

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="session")
def shared_models(tmp_path_factory):
    """One models dir for these tests: the first `up` imports SmolLM2 into it (about a minute), later ones reuse it."""
    return tmp_path_factory.mktemp("e2e-models")


@pytest.fixture
def fresh_env(tmp_path, shared_models):
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY")}
    env.update(LIGHTNING_DATA_DIR=str(tmp_path / "data"), LIGHTNING_MODELS_DIR=str(shared_models),
               PYTHONUNBUFFERED="1")
    yield env
    pidfile = tmp_path / "data" / "redis" / "redis.pid"  # the embedded Redis this test started
    if pidfile.exists():
        try:
            os.kill(int(pidfile.read_text()), signal.SIGTERM)
        except ProcessLookupError:
            pass


_OUTPUT: dict[int, queue.Queue] = {}


def _output(proc) -> queue.Queue:
    """proc's output lines as a reader thread hands them over (None at the end): a bare readline would wait past
    any deadline for a line that never comes."""
    if proc.pid not in _OUTPUT:
        lines = _OUTPUT[proc.pid] = queue.Queue()

        def pump():
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True, name=f"output-{proc.pid}").start()
    return _OUTPUT[proc.pid]


def read_until(proc, pattern, timeout=120):
    lines, deadline, output = [], time.monotonic() + timeout, _output(proc)
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = output.get(timeout=left)
        except queue.Empty:
            break
        if line is None:
            break
        lines.append(line)
        if re.search(pattern, line):
            return "".join(lines)
    raise AssertionError(f"{pattern!r} not seen; output:\n{''.join(lines)}")


def test_up_serves_the_app_and_runs_the_worker(fresh_env, tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "manage.py", "up", "--port", str(port)], cwd=ROOT, env=fresh_env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output = read_until(proc, r"lightning-web is running at", timeout=300)
        redis_pid = int((tmp_path / "data" / "redis" / "redis.pid").read_text())  # the server removes it on exit
        password = re.search(r"Log in as: admin / (\S+)", output).group(1)
        token = re.search(r"API token of admin: (\w+)", output).group(1)
        assert f"http://127.0.0.1:{port}/" in output and "Demo ready" in output
        redis_password = (tmp_path / "data" / "redis" / "password").read_text().strip()
        output += read_until(proc, r"API docs: .* Redis: ", timeout=30)
        assert "Redis: redis://:***@127.0.0.1:" in output and redis_password not in output  # shown redacted
        assert (tmp_path / "data" / "db.sqlite3").exists() and (tmp_path / "data" / "redis" / "port").exists()
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base, timeout=30) as http:
            login = http.get("/accounts/login/")
            assert login.status_code == 200 and 'name="username"' in login.text
            docs = http.get("/api/docs/")
            assert docs.status_code == 200 and "swagger-ui-bundle.js" in docs.text
            bundle = re.search(r'src="([^"]*swagger-ui-bundle\.js)"', docs.text).group(1)
            assert http.get(bundle).status_code == 200  # offline: served by us
            # session login with the printed password
            csrf = http.cookies["csrftoken"]
            page = http.post("/accounts/login/", data={"username": "admin", "password": password,
                                                       "csrfmiddlewaretoken": csrf}, follow_redirects=True)
            assert page.status_code == 200 and str(page.url) == f"{base}/"
            assert "<h1>Runs</h1>" in page.text and '<span class="who">admin</span>' in page.text
            api = {"Authorization": f"Token {token}"}
            demo = http.get("/api/v1/datasets/", headers=api).json()["results"]
            # The demo and the repository task suite (examples/repo_tasks), loaded for the first user.
            assert {d["name"]: (d["train_count"], d["val_count"]) for d in demo} == {
                "arith-word-problems": (400, 100), "repo-tasks": (240, 91)}
            models = http.get("/api/v1/models/", headers=api).json()
            assert [(m["name"], m["origin"]) for m in models] == [("smollm2-135m-instruct", "smollm2-gguf")]
            harness = http.post("/api/v1/harnesses/", headers=api, json={"name": "echo", "command": ["echo", "{task_file}"]})
            assert harness.status_code == 201, harness.text
            dataset = http.post("/api/v1/datasets/", headers=api, data={"name": "two", "val_ratio": "0"},
                                files={"file": ("t.jsonl", b'{"q": 1}\n{"q": 2}\n')})
            assert dataset.status_code == 201 and dataset.json()["train_count"] == 2
            reward = http.get("/api/v1/reward-scripts/", headers=api).json()["results"][0]
            run = http.post("/api/v1/runs/", headers=api, json={
                "name": "smoke", "model": "http://127.0.0.1:9/v1", "config": {"steps": 1}, "harness": harness.json()["id"],
                "dataset": dataset.json()["id"], "reward_script": reward["id"]})
            assert run.status_code == 201 and run.json()["status"] == "queued"
            deadline, status = time.monotonic() + 60, "queued"
            while time.monotonic() < deadline and status in ("queued", "starting"):
                time.sleep(0.5)
                status = http.get(f"/api/v1/runs/{run.json()['id']}/", headers=api).json()["status"]
            assert status == "failed"  # claimed by the worker through the embedded Redis, refused with a reason
            events = http.get(f"/api/v1/runs/{run.json()['id']}/events/", headers=api).json()["results"]
            assert [e["payload"]["status"] for e in events] == ["queued", "starting", "failed"]
            assert "external engine: it cannot be trained" in events[-1]["payload"]["error"]
    finally:
        signal_group(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0
    deadline = time.monotonic() + 10
    while alive(redis_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(redis_pid)  # up stopped the embedded Redis it ran on (the fixture's kill is only a fallback)
    assert pids_matching(f"-p {port}", "lightning_web.asgi") == []


def test_up_again_keeps_the_first_user_and_secret(fresh_env, tmp_path):
    port = free_port()
    command = [sys.executable, "manage.py", "up", "--port", str(port), "--exit-when-ready", "--no-worker"]
    first = subprocess.run(command, cwd=ROOT, env=fresh_env, capture_output=True, text=True, timeout=180)
    second = subprocess.run(command, cwd=ROOT, env=fresh_env, capture_output=True, text=True, timeout=180)
    assert first.returncode == 0 and second.returncode == 0, first.stdout + first.stderr + second.stderr
    login = lambda out: re.search(r"Log in as: (admin / \S+)", out).group(1)  # noqa: E731
    assert login(first.stdout) == login(second.stdout)
    assert (tmp_path / "data" / "secret_key").stat().st_mode & 0o777 == 0o600
