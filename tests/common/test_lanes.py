"""The suite's lanes (tests/lanes.py): each lane keeps its own Redis database and data dir, long modules start
first, and the conformance table and skip rule see every lane's reports (tests/conformance/summary.py)."""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import lanes
from tests.conformance.summary import ROW, SKIPPED, Summary

ROOT = Path(__file__).resolve().parents[2]


def test_each_lane_gets_a_redis_database_of_its_own_never_the_apps():
    assert lanes.lane_redis_db(4, None, "redis://h:6379/3") == 4
    assert lanes.lane_redis_db(4, 0, "redis://h:6379/3") == 4
    assert [lanes.lane_redis_db(4, i, "redis://h:6379/5") for i in (1, 2, 3)] == [6, 7, 8]
    # CI: the tests' default database 15, the app's 0: lanes go below 15
    assert [lanes.lane_redis_db(15, i, "redis://h:6379/0") for i in (1, 2)] == [14, 13]
    assert lanes.lane_redis_db(14, 1, "redis://h:6379/15") == 13  # the app's is skipped
    assert lanes.lane_redis_db(3, 1, "sentinel://:pw@h1:26379/0;sentinel://h2:26379") == 4
    with pytest.raises(pytest.UsageError, match="no Redis database left"):
        lanes.lane_redis_db(15, 16, "redis://h:6379/0")


def test_this_lanes_settings_are_its_own(db):
    from django.conf import settings
    from django.db import connection

    from tests.conftest import TEST_REDIS_DB

    index = lanes.lane()
    assert (index is None) == ("PYTEST_XDIST_WORKER" not in os.environ)
    if index is not None:
        assert connection.settings_dict["NAME"].endswith(f"_gw{index}")  # pytest-django's test database of the lane
        assert Path(settings.DATA_DIR).name == f"gw{index}" and Path(settings.DATA_DIR).parent.name == "lanes"
        assert TEST_REDIS_DB == lanes.lane_redis_db(int(os.environ.get("LIGHTNING_TEST_REDIS_DB", "15")), index,
                                                    settings.REDIS_URL)


def test_a_lane_data_dir_keeps_the_checkouts_agents_and_models(tmp_path):
    code = ("import os, tests.lanes; print(os.environ['LIGHTNING_DATA_DIR']); "
            "print(os.environ['LIGHTNING_HARNESS_TOOLS_DIR']); print(os.environ['LIGHTNING_MODELS_DIR'])")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LIGHTNING_", "PYTEST_XDIST"))}
    env.update(PYTEST_XDIST_WORKER="gw1", LIGHTNING_DATA_DIR=str(tmp_path / "data"))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == [str(tmp_path / "data" / "lanes" / "gw1"), str(tmp_path / "data" / "harness-tools"),
                   str(tmp_path / "data" / "models")]


LANE_PROBE = """
import os, subprocess, sys
import tests.lanes
print(tests.lanes.lane(), os.environ["LIGHTNING_DATA_DIR"], flush=True)
for env in map(eval, sys.argv[1:]):  # processes this one starts, with its environment (and what they change)
    subprocess.run([sys.executable, __file__], env={**os.environ, **env}, check=True)
"""


def test_a_process_a_lane_starts_is_no_second_lane_inside_it(tmp_path):
    """A lane's test that starts `./lw test` (tests/common/test_tiers.py) or any process importing tests.lanes hands
    it the lane's environment: it keeps the lane's data dir (and its embedded Redis) instead of deriving a lane
    folder inside the lane folder (data/lanes/gw0/lanes/gw0, issue 40.12). A nested xdist run's workers are lanes."""
    (tmp_path / "probe.py").write_text(LANE_PROBE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LIGHTNING_", "PYTEST_XDIST"))}
    env.update(PYTEST_XDIST_WORKER="gw0", PYTEST_XDIST_TESTRUNUID="run-a", LIGHTNING_DATA_DIR=str(tmp_path / "data"),
               PYTHONPATH=str(ROOT))
    children = [repr({}), repr({"PYTEST_XDIST_WORKER": "gw1", "PYTEST_XDIST_TESTRUNUID": "run-b"})]
    out = subprocess.run([sys.executable, str(tmp_path / "probe.py"), *children], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    lane_dir = tmp_path / "data" / "lanes" / "gw0"
    assert out == [f"0 {lane_dir}", f"None {lane_dir}", f"1 {lane_dir / 'lanes' / 'gw1'}"]


def test_listed_modules_start_first_longest_first_and_the_rest_keep_their_order(monkeypatch):
    monkeypatch.setattr(lanes, "ORDER", ("tests/b.py", "tests/c.py"))
    items = [SimpleNamespace(nodeid=n) for n in ("tests/a.py::t1", "tests/c.py::t1", "tests/b.py::t1",
                                                 "tests/a.py::t2", "tests/d.py::t1", "tests/c.py::t2")]
    lanes.pytest_collection_modifyitems(None, None, items)
    assert [i.nodeid for i in items] == ["tests/b.py::t1", "tests/c.py::t1", "tests/c.py::t2", "tests/a.py::t1",
                                         "tests/a.py::t2", "tests/d.py::t1"]


def _report(when, *props):
    return SimpleNamespace(when=when, user_properties=list(props))


def test_the_conformance_table_and_skip_rule_read_every_lanes_reports(tmp_path):
    row = {"harness": "codex", "version": "1", "api": "responses", "streaming": True, "calls": 2,
           "drift": {"clean": 2}, "trained_tokens": 5, "engine_tokens": 5}
    summary = Summary(tmp_path / "conformance.json")
    # a test's setup and call reports carry the same properties as its teardown: counted once
    for when in ("setup", "call", "teardown"):
        summary.pytest_runtest_logreport(_report(when, (ROW, row)))
    summary.pytest_runtest_logreport(_report("teardown", (SKIPPED, "openhands")))
    assert [r.harness for r in summary.rows] == ["codex"]
    assert json.loads((tmp_path / "conformance.json").read_text()) == [row]
    written = []
    summary.pytest_terminal_summary(SimpleNamespace(write_sep=lambda *a: written.append(a[1]),
                                                    write_line=written.append))
    assert written[0] == "harness conformance" and "| codex | 1 | responses | yes | 2 | clean 2 | 5 / 5 |" in written[1]
    assert written[2] == f"(all rows measured so far: {tmp_path / 'conformance.json'})"
    session = SimpleNamespace(exitstatus=0, config=SimpleNamespace(pluginmanager=SimpleNamespace(
        get_plugin=lambda name: SimpleNamespace(write_line=lambda *a, **k: written.append(a[0])))))
    summary.pytest_sessionfinish(session)
    assert session.exitstatus == 0  # one harness skipped is allowed
    summary.pytest_runtest_logreport(_report("teardown", (SKIPPED, "codex")))
    summary.pytest_sessionfinish(session)
    assert session.exitstatus == 1
    assert written[-1] == ("FAILED: 2 harnesses skipped (codex, openhands); at most 1 may be: "
                           "run scripts/install-harnesses")


def test_every_module_in_the_order_exists():
    assert [m for m in lanes.ORDER if not (ROOT / m).is_file()] == []
    assert len(set(lanes.ORDER)) == len(lanes.ORDER)


SKIPPING_MODULE = """
def test_{name}(request):
    request.node.user_properties.append(("conformance_skipped", "{name}"))
"""


@pytest.mark.parametrize("lane_args, failed", [(["-n", "2", "--dist", "loadfile"], True), ([], True),
                                                (["-n", "2", "-k", "codex"], False)])
def test_the_skip_rule_counts_the_skips_of_every_lane(tmp_path, lane_args, failed):
    """A real pytest run, in two lanes or one: each module skips one harness, and the controller counts them all."""
    for name in ("codex", "openhands"):
        (tmp_path / f"test_{name}.py").write_text(SKIPPING_MODULE.format(name=name))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "DJANGO_SETTINGS"))}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:django",
                           "-p", "tests.conformance.summary", "--rootdir", str(tmp_path), *lane_args, str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if failed:
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "FAILED: 2 harnesses skipped (codex, openhands); at most 1 may be" in proc.stdout
        assert "2 passed" in proc.stdout
    else:
        assert proc.returncode == 0, proc.stdout
        assert "1 passed" in proc.stdout and "harnesses skipped" not in proc.stdout
