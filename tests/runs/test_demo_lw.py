"""`./lw demo` on a fresh data dir: the app starts as with `./lw up`, the demo run starts, and its URL is printed;
a second `./lw demo` reuses the running app."""
import json
import os
import re
import subprocess
from pathlib import Path

import httpx
import pytest

from common.procs import free_port, kill_group
from runs.management.commands.load_demo import demo_preset
from tests.e2e.test_up import read_until

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture
def demo_env(tmp_path):
    """A fresh data dir; a registry already holding (a marker of) the preset's model, so nothing is imported."""
    model = tmp_path / "models" / demo_preset()["model"]
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (model / "lightning_model.json").write_text(json.dumps({"name": model.name, "origin": "test"}))
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY")}
    env.update(LIGHTNING_DATA_DIR=str(tmp_path / "data"), LIGHTNING_MODELS_DIR=str(tmp_path / "models"),
               LIGHTNING_SKIP_ENGINE="1", PYTHONUNBUFFERED="1")
    yield env
    pidfile = tmp_path / "data" / "redis" / "redis.pid"  # the embedded Redis this test started
    if pidfile.exists():
        try:
            os.kill(int(pidfile.read_text()), 15)
        except ProcessLookupError:
            pass


def test_lw_demo_starts_the_app_and_the_demo_run_then_reuses_the_app(demo_env):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # --no-worker: the runs stay queued, so the test needs no engine; everything else is what a user gets.
    app = subprocess.Popen(["./lw", "demo", "--port", str(port), "--no-worker"], cwd=ROOT, env=demo_env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output = read_until(app, r"Demo run #\d+ .* started for admin: ", timeout=300)
        token = re.search(r"API token of admin: (\w+)", output).group(1)
        first = re.search(r"Demo run #(\d+) .* started for admin: (\S+)", output)
        assert first.group(2) == f"{base}/runs/{first.group(1)}/"
        assert "lightning-web is running at" in output

        again = subprocess.run(["./lw", "demo", "--port", str(port)], cwd=ROOT, env=demo_env, capture_output=True,
                               text=True, timeout=120)
        assert again.returncode == 0, again.stdout + again.stderr
        assert f"the app already answers at {base}/" in again.stdout + again.stderr
        second = re.search(r"Demo run #(\d+) .* started for admin: (\S+)", again.stdout)
        assert second.group(2) == f"{base}/runs/{second.group(1)}/" and second.group(1) != first.group(1)

        runs = httpx.get(f"{base}/api/v1/runs/", headers={"Authorization": f"Token {token}"}).json()["results"]
        preset = demo_preset()
        assert sorted(r["id"] for r in runs) == sorted(int(m.group(1)) for m in (first, second))
        assert {(r["name"], r["model"], r["status"], r["config"]["steps"]) for r in runs} == {
            (preset["name"], preset["model"], "queued", preset["config"]["steps"])}
        assert app.poll() is None  # the app keeps running in the foreground
    finally:
        kill_group(app.pid, grace_s=30)
        app.wait()
