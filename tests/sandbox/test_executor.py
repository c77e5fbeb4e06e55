"""The local executor: a real subprocess per attempt with placeholders, a scrubbed env, timeouts and tails."""
import json
import sys
import time

from common.procs import pids_matching
from sandbox.executors.base import TAIL_BYTES, Attempt
from sandbox.executors.local import LocalExecutor


def attempt(tmp_path, script, timeout_s=10, **extra):
    path = tmp_path / "harness.py"
    path.write_text(script)
    return Attempt(command=[sys.executable, str(path), "{task_file}", "{output_file}", "{task_id}"],
                   env=extra.pop("env", {"MODE": "test", "URL_COPY": "{base_url}"}), timeout_s=timeout_s,
                   workdir=tmp_path / "work", task_id="t-7", task={"q": 2}, rollout_id="11",
                   base_url="http://127.0.0.1:5000/rollouts/11/v1", api_key="key-11", **extra)


async def test_it_fills_placeholders_and_reads_the_output_file(tmp_path):
    script = ("import json, os, sys\n"
              "task = json.load(open(sys.argv[1]))\n"
              "json.dump({'answer': task['q'] * 2, 'id': sys.argv[3], 'env': {k: os.environ[k] for k in os.environ}},"
              " open(sys.argv[2], 'w'))\n"
              "print('done')\n")
    out = await LocalExecutor().run(attempt(tmp_path, script))
    assert out.exit_code == 0 and not out.timed_out and out.error == "" and out.stdout_tail == "done\n"
    assert out.outcome["answer"] == 4 and out.outcome["id"] == "t-7" and out.outcome["exit_code"] == 0
    env = out.outcome["env"]
    assert env["OPENAI_BASE_URL"] == "http://127.0.0.1:5000/rollouts/11/v1" and env["OPENAI_API_KEY"] == "key-11"
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:5000/rollouts/11" and env["ANTHROPIC_API_KEY"] == "key-11"
    assert env["MODE"] == "test" and env["URL_COPY"] == env["OPENAI_BASE_URL"]
    assert json.loads((tmp_path / "work" / "task.json").read_text()) == {"q": 2}


async def test_the_apps_secrets_do_not_reach_the_harness(tmp_path, monkeypatch):
    monkeypatch.setenv("DATABASE_URL", "postgres://secret@db/prod")
    monkeypatch.setenv("SECRET_KEY", "x" * 40)
    script = "import json, os, sys\njson.dump(dict(os.environ), open(sys.argv[2], 'w'))\n"
    env = (await LocalExecutor().run(attempt(tmp_path, script))).outcome
    assert "DATABASE_URL" not in env and "SECRET_KEY" not in env and env["HOME"] == str(tmp_path / "work")


async def test_a_failing_harness_keeps_its_exit_code_and_stderr(tmp_path):
    out = await LocalExecutor().run(attempt(tmp_path, "import sys\nsys.stderr.write('boom\\n')\nsys.exit(3)\n"))
    assert out.exit_code == 3 and out.stderr_tail == "boom\n" and out.error == "harness exited with code 3"
    assert out.outcome == {"exit_code": 3, "stdout": ""}


async def test_a_hanging_harness_is_killed_with_its_children(tmp_path):
    """Its children die with it, setsid'ed ones too (the sandbox's pid namespace); pids inside the sandbox are its
    own, so the child is found by a marker in its command line."""
    marker = f"hang-{tmp_path.name}"
    script = ("import subprocess, sys, time\n"
              f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)  # {marker}'],"
              " start_new_session=True)\n"
              "open('child.pid', 'w').write(str(child.pid))\n"
              "time.sleep(60)\n")
    out = await LocalExecutor().run(attempt(tmp_path, script, timeout_s=1.5))
    assert out.timed_out and out.error == "harness timed out after 1.5 s" and out.exit_code == -9
    assert (tmp_path / "work" / "child.pid").read_text().isdigit()  # it did start
    deadline = time.monotonic() + 5  # SIGKILL lands asynchronously on a busy machine
    while pids_matching(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pids_matching(marker) == []


async def test_output_tails_are_bounded(tmp_path):
    out = await LocalExecutor().run(attempt(tmp_path, "print('x' * 100000)\n"))
    assert len(out.stdout_tail) == TAIL_BYTES and out.exit_code == 0


async def test_a_missing_program_is_a_readable_error(tmp_path):
    bad = Attempt(command=["/nonexistent/agent"], env={}, timeout_s=5, workdir=tmp_path / "w", task_id="t", task={},
                  rollout_id="1", base_url="http://x/v1", api_key="k")
    out = await LocalExecutor().run(bad)
    assert out.exit_code is None and out.error.startswith("harness could not start: [Errno 2]")


async def test_a_non_object_output_file_is_kept(tmp_path):
    out = await LocalExecutor().run(attempt(tmp_path, "import sys\nopen(sys.argv[2], 'w').write('[1, 2]')\n"))
    assert out.outcome["output"] == [1, 2]
    out = await LocalExecutor().run(attempt(tmp_path, "import sys\nopen(sys.argv[2], 'w').write('not json')\n"))
    assert out.outcome["output_raw"] == "not json"



async def test_a_harness_killed_by_a_signal_reports_it_as_a_negative_exit_code(tmp_path):
    out = await LocalExecutor().run(attempt(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n"))
    assert out.exit_code == -15 and out.error == "harness exited with code -15" and not out.timed_out


async def test_a_workdir_past_the_disk_limit_stops_the_harness(tmp_path):
    script = ("import time\n"
              "for i in range(200):\n"
              "    open(f'fill-{i}', 'wb').write(b'x' * (1 << 20))\n"
              "    time.sleep(0.02)\n")
    out = await LocalExecutor().run(attempt(tmp_path, script, timeout_s=30, disk_mb=16))
    assert out.error == "harness stopped: its workdir grew past 16 MB (the disk limit)" and out.exit_code == -9
    assert not out.timed_out and len(list((tmp_path / "work").glob("fill-*"))) < 200
