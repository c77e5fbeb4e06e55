"""The reward sandbox: results and every failure mode come back as readable ScoreResults."""
import os

import pytest

from sandbox.scoring import Limits, score
from tests.isolation_attacks import tmp_mount_points

FAST = Limits(timeout_s=2, memory_mb=256, output_bytes=4096)


def test_it_returns_a_float_reward():
    result = score("def reward(task, outcome):\n    return outcome['n'] * 0.5\n", {}, {"n": 3}, FAST)
    assert result.ok and result.reward == 1.5 and result.detail == {} and result.error == ""


def test_it_returns_the_detail_of_a_dict_reward():
    source = "def reward(task, outcome):\n    print('checking')\n    return {'reward': True, 'tests': 3}\n"
    result = score(source, {}, {}, FAST)
    assert result.ok and result.reward == 1.0 and result.detail == {"tests": 3} and result.output == "checking\n"


@pytest.mark.parametrize("body, kind, error", [
    ("    return 1 / 0", "exception", "ZeroDivisionError: division by zero (line 2)"),
    ("    raise SystemExit(3)", "exception", "SystemExit: 3 (line 2)"),
    ("    return 'high'", "exception", "TypeError: reward() must return a number or {'reward': number, ...}, got str"),
    ("    return float('nan')", "exception", "ValueError: reward() returned nan, which is not a finite number"),
    ("    return {'score': 1}", "exception", "TypeError: reward() returned a dict without a 'reward' key"),
    ("    return {'reward': 1, 'obj': object()}", "exception", "TypeError: Object of type object is not JSON serializable"),
])
def test_user_errors_are_readable(body, kind, error):
    result = score(f"def reward(task, outcome):\n{body}\n", {}, {}, FAST)
    assert not result.ok and result.kind == kind and result.error == error and result.reward is None


def test_a_script_declares_an_unparseable_outcome_without_importing_anything():
    """Issue 26.4: UnparseableOutcome is in every script's namespace; raising it is its own kind, not a crash."""
    source = ("def reward(task, outcome):\n"
              "    if 'answer' not in outcome:\n"
              "        raise UnparseableOutcome('no answer block in the output')\n"
              "    return 1.0\n")
    result = score(source, {}, {"text": "```````"}, FAST)
    assert not result.ok and result.kind == "unparseable" and result.reward is None
    assert result.error == "UnparseableOutcome: no answer block in the output"
    assert score(source, {}, {"answer": 4}, FAST).reward == 1.0


def test_a_syntax_error_names_the_line():
    result = score("x = 1\ndef reward(task outcome):\n    pass\n", {}, {}, FAST)
    assert not result.ok and result.kind == "syntax" and result.error == "SyntaxError: invalid syntax (line 2)"


def test_a_missing_function_is_reported():
    result = score("def score(task, outcome):\n    return 1\n", {}, {}, FAST)
    assert not result.ok and result.error == "NameError: the script must define a function reward(task, outcome)"


def test_an_infinite_loop_times_out():
    result = score("def reward(task, outcome):\n    while True:\n        pass\n", {}, {}, Limits(timeout_s=1))
    assert not result.ok and result.kind == "timeout" and result.error == "the reward script timed out after 1 s"
    assert 900 <= result.duration_ms < 5000


def test_a_sleeping_script_times_out_on_wall_time():
    result = score("import time\ndef reward(task, outcome):\n    time.sleep(30)\n", {}, {}, Limits(timeout_s=1))
    assert not result.ok and result.kind == "timeout"


def test_infinite_output_is_cut():
    result = score("def reward(task, outcome):\n    while True:\n        print('spam' * 100)\n", {}, {}, FAST)
    assert not result.ok and result.kind == "output" and "printed more than 4096 bytes" in result.error
    assert len(result.output) <= 4096


def test_a_memory_bomb_is_stopped():
    result = score("def reward(task, outcome):\n    blob = bytearray(4 * 1024 ** 3)\n    return 1\n", {}, {}, FAST)
    assert not result.ok and result.kind == "memory" and "ran out of memory" in result.error


def test_a_hard_exit_is_reported():
    result = score("import os\ndef reward(task, outcome):\n    os._exit(7)\n", {}, {}, FAST)
    assert not result.ok and result.kind == "crashed" and "exit code 7" in result.error


def test_a_killed_process_is_reported():
    result = score("import os, signal\ndef reward(task, outcome):\n    os.kill(os.getpid(), signal.SIGKILL)\n",
                   {}, {}, FAST)
    assert not result.ok and result.kind == "crashed" and "killed by SIGKILL" in result.error


def test_the_environment_is_scrubbed(monkeypatch):
    monkeypatch.setenv("DATABASE_URL", "postgres://secret@db/prod")
    monkeypatch.setenv("SECRET_KEY", "s3cret")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-live")
    source = "import os\ndef reward(task, outcome):\n    return {'reward': 0, 'env': dict(os.environ)}\n"
    env = score(source, {}, {}, FAST).detail["env"]
    assert not {"DATABASE_URL", "SECRET_KEY", "OPENAI_API_KEY"} & set(env)
    assert set(env) <= {"PATH", "LANG", "LC_ALL", "TZ", "HOME", "TMPDIR", "PYTHONHASHSEED", "PYTHONIOENCODING",
                        "OMP_NUM_THREADS", "PWD"}  # PWD: bubblewrap's, the sandbox's own /tmp


def test_it_runs_in_a_throwaway_directory():
    """Its workdir is the sandbox's private /tmp: what it writes there is gone with the sandbox, never on the host."""
    source = ("import os\ndef reward(task, outcome):\n    open('f-7c1.txt', 'w').write('x')\n"
              "    return {'reward': 1, 'cwd': os.getcwd(), 'files': os.listdir('.')}\n")
    result = score(source, {}, {}, FAST)
    assert result.ok and result.detail["cwd"] == "/tmp"
    assert sorted(result.detail["files"]) == sorted(["f-7c1.txt", *tmp_mount_points()])
    assert not os.path.exists("/tmp/f-7c1.txt")


def test_unserialisable_input_is_refused_before_starting():
    result = score("def reward(t, o):\n    return 1\n", {"x": object()}, {}, FAST)
    assert not result.ok and result.kind == "invalid" and "not JSON" in result.error
