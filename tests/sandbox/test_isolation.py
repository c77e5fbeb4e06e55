"""Isolation of user code (sandbox.isolation): every attack of tests/isolation_attacks.py fails for a reward script
and for a harness, the next score and attempt still work, a harness reaches its proxy and nothing else, and where
bubblewrap cannot run user code is refused unless LIGHTNING_UNSAFE_LOCAL_EXEC=1 (test_isolation_refusal.py)."""
import asyncio
import os
import sys
from pathlib import Path

import pytest
from django.conf import settings as django_settings

from catalog import harness_templates
from sandbox import isolation
from sandbox.executors.local import LocalExecutor
from sandbox.scoring import score
from tests.isolation_attacks import (
    ATTACKS,
    REWARD_LIMITS,
    harness_attempt,
    run_harness,
    run_reward,
    still_works,
    tmp_mount_points,
)
from tests.isolation_attacks import targets as make_targets

pytestmark = pytest.mark.skipif(not isolation.probe(isolation.bwrap_path() or "bwrap")[0],
                                reason="bubblewrap cannot run on this machine (test_isolation_refusal.py covers that)")


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("isolation")
    with make_targets(tmp) as ctx:
        yield ctx, tmp


def test_the_targets_are_real(targets):
    """A failed read means a blocked one: every secret exists and this process (the app) can read it."""
    ctx, _ = targets
    for key in ("secret_key", "admin_password", "sqlite", "planted", "other_rollout", "source"):
        for path in ctx[key]:
            assert Path(path).read_bytes(), path
    assert any(Path(p).exists() for p in ctx["sockets"])  # PostgreSQL's socket at least
    assert ["127.0.0.1", ctx["redis"][0][1]] in ctx["listening"] and ctx["web"][0] in ctx["listening"]


@pytest.mark.parametrize("attack", ATTACKS, ids=[a.name for a in ATTACKS])
def test_a_reward_script_cannot_escape(attack, targets):
    ctx, tmp = targets
    verdict = run_reward(attack, ctx)
    assert verdict.escaped is None, f"{attack.name}: {verdict.escaped}"
    assert still_works(ctx, tmp) == (True, True)


@pytest.mark.parametrize("attack", ATTACKS, ids=[a.name for a in ATTACKS])
def test_a_harness_cannot_escape(attack, targets):
    ctx, tmp = targets
    verdict = run_harness(attack, ctx, tmp)
    assert verdict.escaped is None, f"{attack.name}: {verdict.escaped}"
    if attack.name == "fill the disk with many files":
        assert verdict.detail == "harness stopped: its workdir grew past 32 MB (the disk limit)"
    if attack.name == "keep a child running after the timeout":
        assert verdict.detail == "harness timed out after 4 s"
    assert still_works(ctx, tmp) == (True, True)


def test_a_reward_script_sees_python_and_a_private_tmp_only(targets):
    ctx, _ = targets
    source = ("import os, sys\ndef reward(task, outcome):\n"
              "    return {'reward': 1, 'prefix': sys.prefix, 'tmp': os.listdir('/tmp'), 'cwd': os.getcwd(),\n"
              "            'data': os.path.exists(task['data']) and os.listdir(task['data']),\n"
              "            'base': os.path.exists(task['base']) and os.listdir(task['base'])}\n")
    result = score(source, {"data": str(django_settings.DATA_DIR), "base": str(django_settings.BASE_DIR)}, {},
                   REWARD_LIMITS)
    assert result.ok and os.path.realpath(result.detail["prefix"]) == os.path.realpath(sys.prefix)
    assert result.detail["cwd"] == "/tmp" and result.detail["tmp"] == tmp_mount_points()
    assert result.detail["data"] in (False, [])  # gone, or an empty tmpfs
    # The source tree is hidden; only the venv comes back (read-only) when it lies inside it. The runner is seen in
    # the sandbox's private /run, not at its path.
    assert result.detail["base"] in (False, [], [".venv"])


def _harness(tmp: Path, ctx: dict, body: str):
    script = tmp / "probe.py"
    script.write_text("import json, os, sys, urllib.request\nctx = json.load(open(sys.argv[1]))\n" + body)
    return asyncio.run(LocalExecutor().run(harness_attempt(["python3", str(script), "{task_file}", "{output_file}"],
                                                           ctx, Path(ctx["workdir"]))))


def test_a_harness_reaches_its_proxy_through_the_relay_and_nothing_else(targets):
    ctx, tmp = targets
    out = _harness(tmp, ctx, (
        "got = json.load(urllib.request.urlopen(ctx['proxy_url'] + '/models', timeout=5))\n"
        "try:\n"
        "    urllib.request.urlopen(f\"http://127.0.0.1:{ctx['web'][0][1]}/\", timeout=2)\n"
        "    web = 'reached'\n"
        "except OSError as exc:\n"
        "    web = 'refused'\n"
        "json.dump({'proxy': got, 'web': web, 'base_url': os.environ['OPENAI_BASE_URL']}, open(sys.argv[2], 'w'))\n"))
    assert out.error == "" and out.exit_code == 0, out.stderr_tail
    assert out.outcome["proxy"] == {"ok": True, "path": "/rollouts/1/v1/models"}
    assert out.outcome["web"] == "refused" and out.outcome["base_url"] == ctx["proxy_url"]


def test_a_harness_sees_its_workdir_read_write_and_its_script_read_only(targets):
    ctx, tmp = targets
    out = _harness(tmp, ctx, (
        "open('mine.txt', 'w').write('ok')\n"
        "try:\n"
        "    open(os.path.join(os.path.dirname(sys.argv[0]), 'x.txt'), 'w')\n"
        "    script_dir = 'writable'\n"
        "except OSError:\n"
        "    script_dir = 'read-only'\n"
        "json.dump({'cwd': os.getcwd(), 'script_dir': script_dir, 'home': os.environ['HOME'],\n"
        "           'rollouts': os.listdir(os.path.dirname(os.getcwd()))}, open(sys.argv[2], 'w'))\n"))
    assert out.exit_code == 0, out.stderr_tail
    assert out.outcome["cwd"] == ctx["workdir"] == out.outcome["home"] and out.outcome["script_dir"] == "read-only"
    assert out.outcome["rollouts"] == ["1"]  # its own folder only: rollout 2 beside it is hidden
    assert (Path(ctx["workdir"]) / "mine.txt").read_text() == "ok"
    (Path(ctx["workdir"]) / "mine.txt").unlink()
    (Path(ctx["workdir"]) / "task.json").unlink()
    (Path(ctx["workdir"]) / "output.json").unlink()


def test_a_harness_naming_a_protected_file_is_refused(targets):
    ctx, _ = targets
    secret = ctx["secret_key"][0]
    out = asyncio.run(LocalExecutor().run(harness_attempt(["cat", secret], ctx, Path(ctx["workdir"]))))
    assert out.exit_code is None and out.stdout_tail == ""
    assert out.error == (f"harness could not start: the file {os.path.realpath(secret)} is inside the app's data dir "
                         f"({os.path.realpath(django_settings.DATA_DIR)}), which user code may not see")


def test_a_declared_read_only_path_in_the_data_dir_is_refused_but_the_tools_dir_is_shown(targets, settings, tmp_path):
    ctx, _ = targets
    attempt = harness_attempt(["true"], ctx, Path(ctx["workdir"]))
    refused = asyncio.run(LocalExecutor().run(
        type(attempt)(**{**attempt.__dict__, "read_only": (str(django_settings.DATA_DIR),)})))
    assert refused.exit_code is None and "is inside the app's data dir" in refused.error
    tools = Path(django_settings.DATA_DIR) / f"harness-tools-{tmp_path.name}"
    (tools / "bin").mkdir(parents=True)
    (tools / "bin" / "agent").write_text("#!/bin/sh\necho agent ran\n")
    (tools / "bin" / "agent").chmod(0o755)
    settings.LIGHTNING_HARNESS_TOOLS_DIR = tools
    try:
        shown = asyncio.run(LocalExecutor().run(type(attempt)(**{
            **attempt.__dict__, "command": [str(tools / "bin" / "agent")], "read_only": (str(tools),)})))
    finally:
        for path in sorted(tools.rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        tools.rmdir()
    assert shown.exit_code == 0 and shown.stdout_tail == "agent ran\n", shown.stderr_tail


def test_templates_declare_their_runner_folder_and_the_tools_dir():
    for template in harness_templates.templates():
        read_only = template.fields()["resources"]["read_only"]
        assert read_only == [str(harness_templates.TEMPLATES_DIR), str(harness_templates.tools_dir())], template.slug


def test_the_run_says_which_isolation_it_used():
    text = isolation.current().describe()
    assert text.startswith("bubblewrap 0.11.0: harnesses reach only the proxy, reward scripts no network; pids<=512")


def test_the_cross_run_key_attacks_of_the_isolation_bench_all_stop():
    """bench/isolation_attacks.py's cross-run key part (issue 26.1) as RELIABILITY.md runs it: a rollout key of one
    user's run against another user's run proxy, every endpoint, through a real proxy server; nothing answers,
    reaches the other engine or is recorded."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "bench" / "isolation_attacks.py"
    done = subprocess.run([sys.executable, str(script), "--cross-run"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[-1] == "RESULT cross_run_key_escapes=0 cross_run_key_attacks=16", done.stdout[-3000:]
    attacks = [line for line in lines if "cross-run key" in line]
    assert len(attacks) == 16 and all("stopped (404)" in line for line in attacks[:8])
    assert all("stopped (401)" in line for line in attacks[8:])


def test_without_a_memory_cgroup_a_harness_is_held_by_its_address_space(targets, monkeypatch):
    """Issue 26.6: where no memory cgroup is writable, RLIMIT_AS bounds the harness (a looser bound, and what the
    run's isolation line then says)."""
    from sandbox import isolation
    from tests.isolation_attacks import ATTACKS, run_harness

    ctx, tmp = targets
    monkeypatch.setattr(isolation, "memory_root", lambda: None)
    bomb = next(a for a in ATTACKS if a.name.startswith("exhaust memory"))
    verdict = run_harness(bomb, ctx, tmp)
    assert verdict.escaped is None, verdict
    assert "harness memory<=512 MB (RLIMIT_AS)" in isolation.current().describe()
