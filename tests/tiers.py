"""A pytest plugin (tests/conftest.py loads it): each collected test is in the fast tier or carries the `full` marker.

`./lw test` runs `-m "not full"`: unit and integration tests on the database and Redis. `./lw test --all` runs
everything. A test is in the full tier when it has one of FULL_MARKERS, lives in one of FULL_DIRS, needs the engine
venv (its skip says "no engine venv"), or when it or a fixture it uses (directly or through other fixtures) names an
entry point in STARTS: a test written on top of the `workers` fixture or a vLLM engine fixture lands in the full tier
without a marker of its own. Helpers defined under tests/ that the code calls are followed too.

`--tier-report PATH` writes each collected test's tier, reason, markers and fixtures to PATH as JSON (why a test
is where it is; tests/common/test_tiers.py checks the selection with it). No Django here.
"""
from __future__ import annotations

import inspect
import json
import types
from pathlib import Path

import pytest

FULL_MARKERS = ("slow", "e2e", "browser", "vllm", "conformance")
FULL_DIRS = ("e2e", "browser", "conformance")
STARTS = {
    "Workers": "Celery worker processes",
    "real_run": "Celery worker processes",
    "sync_playwright": "Chromium",
    "async_playwright": "Chromium",
    "managed_engine": "vLLM from the engine venv",
    "default_engine_venv": "vLLM from the engine venv",
}
"""Names that, referenced by a test's or a fixture's code, start what the fast tier leaves out."""
ENGINE_VENV_SKIP = "no engine venv"
TESTS_DIR = Path(__file__).resolve().parent


def pytest_addoption(parser):
    parser.addoption("--tier-report", metavar="PATH", default=None,
                     help="write each collected test's tier, reason, markers and fixtures to PATH as JSON")


def _code_names(code: types.CodeType) -> set[str]:
    """Every global, attribute and imported name a code object and the functions nested in it refer to."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _starts(func, seen: set) -> str | None:
    """What `func` starts (a STARTS value), following the functions defined under tests/ that it refers to."""
    func = inspect.unwrap(func)
    code = getattr(func, "__code__", None)
    if code is None or func in seen:
        return None
    seen.add(func)
    names = _code_names(code)
    hits = sorted(names & STARTS.keys())
    if hits:
        return STARTS[hits[0]]
    namespace = getattr(func, "__globals__", {})
    for name in sorted(names):
        helper = namespace.get(name)
        if isinstance(helper, types.FunctionType) and helper.__module__.startswith("tests."):
            found = _starts(helper, seen)
            if found:
                return found
    return None


def _used_fixture_funcs(item):
    """The functions of the fixtures `item` uses, overridden ones included where the override requests them."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return
    for name in item.fixturenames:
        for fixturedef in reversed(info.name2fixturedefs.get(name, ())):
            yield name, fixturedef.func
            if name not in fixturedef.argnames:  # an override that does not build on the one it hides
                break


def full_reason(item, cache: dict) -> str | None:
    """Why `item` is in the full tier, or None when it is in the fast one."""
    for marker in FULL_MARKERS + ("full",):
        if item.get_closest_marker(marker):
            return f"marker {marker}"
    path = Path(str(item.path)).resolve()
    if path.is_relative_to(TESTS_DIR):
        top = path.relative_to(TESTS_DIR).parts[0]
        if top in FULL_DIRS:
            return f"in tests/{top}"
    for skip in item.iter_markers("skipif"):
        if ENGINE_VENV_SKIP in str(skip.kwargs.get("reason", "")):
            return "needs the engine venv"
    function = getattr(item, "function", None)
    if function is not None:
        found = _starts(function, set())
        if found:
            return f"starts {found}"
    for name, func in _used_fixture_funcs(item):
        if func not in cache:
            module = getattr(inspect.unwrap(func), "__module__", "") or ""
            cache[func] = _starts(func, set()) if module.startswith("tests") else None
        if cache[func]:
            return f"fixture {name} starts {cache[func]}"
    return None


@pytest.hookimpl(tryfirst=True)  # before `-m` selects on the marker
def pytest_collection_modifyitems(session, config, items):
    cache: dict = {}
    report = []
    for item in items:
        reason = full_reason(item, cache)
        if reason and not item.get_closest_marker("full"):
            item.add_marker(pytest.mark.full(reason=reason))
        if config.getoption("tier_report"):
            report.append({"nodeid": item.nodeid, "tier": "full" if reason else "fast", "reason": reason,
                           "markers": sorted({m.name for m in item.iter_markers()}),
                           "fixtures": sorted(item.fixturenames)})
    if config.getoption("tier_report"):
        Path(config.getoption("tier_report")).write_text(json.dumps(report, indent=1))
