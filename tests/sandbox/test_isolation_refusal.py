"""Where bubblewrap cannot run (here: LIGHTNING_BWRAP names a missing binary), user code is refused with a clear
error, a run does not start, and LIGHTNING_UNSAFE_LOCAL_EXEC=1 runs it unisolated and says so on the run."""
import asyncio
import sys

import pytest
from django.utils.html import escape

from runs.models import Run
from runs.orchestrator import RunSetupError, record_isolation
from sandbox import isolation
from sandbox.executors.base import Attempt
from sandbox.executors.local import LocalExecutor
from sandbox.scoring import Limits, score

LIMITS = Limits(timeout_s=5, memory_mb=256, output_bytes=4096)
REFUSED = "user code is not run: bubblewrap cannot isolate it on this machine (/nonexistent/bwrap: [Errno 2] No such"


@pytest.fixture
def no_bwrap(settings):
    settings.LIGHTNING_BWRAP = "/nonexistent/bwrap"
    settings.LIGHTNING_UNSAFE_LOCAL_EXEC = False
    return settings


def attempt(tmp_path, command):
    return Attempt(command=command, env={}, timeout_s=10, workdir=tmp_path / "work", task_id="t", task={"q": 1},
                   rollout_id="1", base_url="http://127.0.0.1:9/rollouts/1/v1", api_key="k")


def test_a_reward_script_and_a_harness_are_refused(no_bwrap, tmp_path):
    with pytest.raises(isolation.IsolationError, match="or set LIGHTNING_UNSAFE_LOCAL_EXEC=1 to run"):
        isolation.current()
    result = score("def reward(task, outcome):\n    return 1.0\n", {}, {}, LIMITS)
    assert not result.ok and result.kind == "refused" and result.reward is None and result.error.startswith(REFUSED)
    (tmp_path / "h.py").write_text("open('ran', 'w').write('yes')\n")
    out = asyncio.run(LocalExecutor().run(attempt(tmp_path, [sys.executable, str(tmp_path / "h.py")])))
    assert out.exit_code is None and out.error.startswith(f"harness could not start: {REFUSED}")
    assert not (tmp_path / "work" / "ran").exists()


@pytest.mark.django_db
def test_a_run_does_not_start_and_keeps_no_isolation(no_bwrap, alice, make_run):
    run = make_run(alice)
    with pytest.raises(RunSetupError, match="LIGHTNING_UNSAFE_LOCAL_EXEC=1") as refused:
        record_isolation(run.pk)
    assert str(refused.value).startswith(REFUSED)
    assert Run.objects.get(pk=run.pk).isolation == ""


@pytest.mark.django_db
def test_unsafe_exec_runs_user_code_unisolated_and_the_run_says_so(no_bwrap, alice, make_run, client, tmp_path):
    no_bwrap.LIGHTNING_UNSAFE_LOCAL_EXEC = True
    run = make_run(alice)
    assert record_isolation(run.pk) == "none (LIGHTNING_UNSAFE_LOCAL_EXEC=1)"
    assert Run.objects.get(pk=run.pk).isolation == "none (LIGHTNING_UNSAFE_LOCAL_EXEC=1)"
    result = score("import os\ndef reward(task, outcome):\n    return {'reward': 1.0, 'cwd': os.getcwd()}\n", {}, {},
                   LIMITS)
    assert result.ok and result.reward == 1.0 and result.detail["cwd"] != "/tmp"  # its temp folder on the host
    (tmp_path / "h.py").write_text("open('ran', 'w').write(open('/proc/1/cmdline').read()[:30])\n")
    out = asyncio.run(LocalExecutor().run(attempt(tmp_path, [sys.executable, str(tmp_path / "h.py")])))
    assert out.exit_code == 0 and out.error == ""
    assert "bwrap" not in (tmp_path / "work" / "ran").read_text()  # no sandbox's pid 1 above it
    client.force_login(alice)
    page = client.get(f"/runs/{run.pk}/")
    assert page.status_code == 200
    assert '<dd id="run-isolation">none (LIGHTNING_UNSAFE_LOCAL_EXEC=1)</dd>' in page.content.decode()
    api = client.get(f"/api/v1/runs/{run.pk}/")
    assert api.status_code == 200 and api.json()["isolation"] == "none (LIGHTNING_UNSAFE_LOCAL_EXEC=1)"


@pytest.mark.django_db
@pytest.mark.skipif(not isolation.probe(isolation.bwrap_path() or "bwrap")[0], reason="bubblewrap cannot run here")
def test_a_run_records_bubblewrap_and_its_limits(alice, make_run, client):
    run = make_run(alice)
    text = record_isolation(run.pk)
    assert text.startswith("bubblewrap 0.11.0: harnesses reach only the proxy, reward scripts no network; pids<=512")
    assert Run.objects.get(pk=run.pk).isolation == text
    client.force_login(alice)
    assert f'<dd id="run-isolation">{escape(text)}</dd>' in client.get(f"/runs/{run.pk}/").content.decode()
    assert client.get(f"/api/v1/runs/{run.pk}/").json()["isolation"] == text


@pytest.mark.django_db
def test_the_api_refuses_a_read_only_path_in_the_data_dir(alice_api, settings):
    body = {"name": "peeker", "command": ["true"], "resources": {"read_only": [str(settings.DATA_DIR)]}}
    response = alice_api.post("/api/v1/harnesses/", body, format="json")
    assert response.status_code == 400
    assert "is inside the app's data dir" in response.json()["error"]["fields"]["resources"][0]
    body["resources"] = {"read_only": ["relative/path"]}
    response = alice_api.post("/api/v1/harnesses/", body, format="json")
    assert response.status_code == 400 and "absolute paths" in response.json()["error"]["fields"]["resources"][0]
    body["resources"] = {"read_only": [str(settings.LIGHTNING_HARNESS_TOOLS_DIR)]}
    response = alice_api.post("/api/v1/harnesses/", body, format="json")
    assert response.status_code == 201 and response.json()["resources"] == body["resources"]
