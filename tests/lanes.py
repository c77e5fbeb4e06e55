"""A pytest plugin (pytest.ini loads it with `-p`, before Django starts): the suite in parallel lanes.

`./lw test` and `./lw test --all` run pytest-xdist with one lane (process) per CPU core, at least two, a whole module
to a lane (`--dist loadfile`, so a module-scoped engine starts once). Each lane is a test session of its own, as a
second session on the same machine already is (tests/conftest.py): its own test database (pytest-django's `_gwN`
suffix), its own Redis database for the tests' queues and channel groups (`lane_redis_db`), and its own data dir
(LIGHTNING_DATA_DIR/lanes/gwN: runs, engine caches and the embedded Redis never meet another lane's, though two lanes
number their runs alike). The real agents and the models registry stay where the checkout put them. A process a lane
starts inherits the lane's environment and is no lane of its own (a `./lw test` a test runs keeps the lane's data dir;
it derived data/lanes/gw0/lanes/gw0 and started a Redis there before); a nested xdist run's workers are lanes.

Modules start longest first (`ORDER`, measured on this 2-core machine) so that no lane is left with a long
module at the end; a module not listed starts after the listed ones. The order changes no result, only the wall time.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ORDER = (
    "tests/trainer/test_gemma3_import.py",  # 508 s
    "tests/runs/test_repo_agent_run.py",  # 396 s
    "tests/e2e/test_faults_infra.py",  # 381 s
    "tests/runs/test_disk_run.py",  # 291 s (2026-12-07: with the 32-in-flight workdir run)
    "tests/trainer/test_engine_vllm.py",  # 264 s
    "tests/trainer/test_sampling_distribution.py",  # 226 s
    "tests/dashboard/test_export_memory.py",  # 154 s
    "tests/runs/test_durable_worker.py",  # 148 s
    "tests/runs/test_host_formats.py",  # 132 s
    "tests/common/test_session_leftovers.py",  # 129 s (one process, on this machine beside other sessions)
    "tests/e2e/test_engine_replicas.py",  # 119 s
    "tests/runs/test_orchestrator.py",  # 114 s
    "tests/browser/test_new_user_path_in_chromium.py",  # 102 s
    "tests/runs/test_checkpoint_model_run.py",  # 82 s
    "tests/e2e/test_no_secrets_in_logs.py",  # 93 s
    "tests/browser/test_run_page_in_chromium.py",  # 92 s
    "tests/e2e/test_faults_user_code.py",  # 91 s
    "tests/e2e/test_up.py",  # 84 s
    "tests/api/test_api_fuzz.py",  # 79 s
    "tests/browser/test_inspector_in_chromium.py",  # 76 s
    "tests/sandbox/test_isolation.py",  # 54 s
    "tests/examples/test_repo_tasks.py",  # 51 s
    "tests/runs/test_harness_check_pages.py",  # 47 s
    "tests/trainer/test_distributed.py",  # 46 s
    "tests/runs/test_finish_run.py",  # 41 s
    "tests/runs/test_dynamic_sampling_run.py",  # 40 s
    "tests/browser/test_harness_reward_in_chromium.py",  # 40 s
    "tests/runs/test_reward_script_failures_run.py",  # 39 s
    "tests/common/test_tiers.py",  # 38 s
    "tests/browser/test_pages_in_chromium.py",  # 36 s
    "tests/trainer/test_models.py",  # 35 s
    "tests/e2e/test_up_supervision.py",  # 34 s
    "tests/proxy/test_vllm.py",  # 33 s
    "tests/browser/test_xss_in_chromium.py",  # 32 s
    "tests/runs/test_pools.py",  # 31 s
    "tests/catalog/test_api_reward_scripts.py",  # 31 s
)
"""Test modules of 30 s or more, longest first (seconds in `--junitxml` of `.ci/run` in two lanes on this 2-core
machine, 2026-12-06: 4,586 s of tests in 39 min)."""


PINNED_ENV = "LIGHTNING_TEST_LANE_PINNED"
"""The xdist run and worker (`<PYTEST_XDIST_TESTRUNUID>/gwN`) whose lane this environment was pinned for."""


def _this_process_lane() -> int | None:
    """The lane of this process: an xdist worker's number, unless it only inherited a worker's environment (a
    `./lw test` or `manage.py` a lane's test starts is no lane of its own; a nested xdist run's workers are)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or os.environ.get(PINNED_ENV) == _pinned_for(worker):
        return None
    return int(worker.removeprefix("gw"))


def _pinned_for(worker: str) -> str:
    return f"{os.environ.get('PYTEST_XDIST_TESTRUNUID', '')}/{worker}"


LANE = _this_process_lane()


def lane() -> int | None:
    """This process's lane (0, 1, ...) under pytest-xdist; None in a plain pytest run, in xdist's controller and in
    a process a lane starts."""
    return LANE


def lane_redis_db(base: int, lane_index: int | None, app_url: str = "") -> int:
    """The Redis database of a lane's tests: `base` for lane 0 (or no lane), then the next free ones above it, or
    below it where there is no room above (Redis has 16); never the app's own (the database of `app_url`)."""
    if not lane_index:
        return base
    app_db = app_url.rsplit("/", 1)[-1]
    taken = {base} | ({int(app_db)} if app_db.isdigit() else set())
    candidates = [db for db in range(base + 1, 16) if db not in taken]
    candidates += [db for db in range(base - 1, -1, -1) if db not in taken]
    if lane_index > len(candidates):
        raise pytest.UsageError(f"lane {lane_index}: no Redis database left beside {base} (16 in all)")
    return candidates[lane_index - 1]


def _pin_data_dir() -> None:
    """Give this lane a data dir of its own, once; the real agents and the models registry stay at the checkout's."""
    if LANE is None:
        return
    base = Path(os.environ.get("LIGHTNING_DATA_DIR") or ROOT / "data").expanduser().resolve()
    os.environ.setdefault("LIGHTNING_HARNESS_TOOLS_DIR", str(base / "harness-tools"))
    os.environ.setdefault("LIGHTNING_MODELS_DIR", str(base / "models"))
    os.environ["LIGHTNING_DATA_DIR"] = str(base / "lanes" / f"gw{LANE}")
    os.environ[PINNED_ENV] = _pinned_for(f"gw{LANE}")  # what this lane's processes inherit: not lanes themselves


_pin_data_dir()  # at import: `-p tests.lanes` loads this before pytest-django reads the settings


def pytest_collection_modifyitems(session, config, items):
    """Modules in ORDER first, longest first; the rest after them, in their own order (a stable sort)."""
    rank = {module: i for i, module in enumerate(ORDER)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
