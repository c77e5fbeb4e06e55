"""Every attack of tests/isolation_attacks.py through the real sandboxes, as a reward script and as a harness.

Prints one line per attack and place, then `RESULT isolation_escapes=<n> isolation_attacks=<m>
cross_run_key_escapes=<n> cross_run_key_attacks=<m>`. With --unisolated it runs them with bubblewrap made unavailable
and LIGHTNING_UNSAFE_LOCAL_EXEC=1, to show what the attacks reach without it (the escapes then are the point; never do
this on a machine with real secrets).

The cross-run key attacks (issue 26.1) are a harness of one user's run holding its rollout's key and calling the
proxy of another user's run, as it could wherever two runs' proxies share a network (the cluster deployment, a
worker holding several runs): every endpoint, with its own rollout id and with the other run's. An escape is an
answer under 400, a request that reached the other run's engine, or a call recorded anywhere. They run in a
subprocess of this script (`--cross-run`) on a fresh SQLite database of their own, through a real proxy server.

    .venv/bin/python bench/isolation_attacks.py
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lightning_web.settings")


class _CountingEngine:
    """The other run's engine: tests/proxy/fake_upstream.FakeVLLM, counting the requests that reach it."""

    def __init__(self) -> None:
        from tests.proxy.fake_upstream import FakeVLLM

        self.app, self.requests = FakeVLLM(), 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            self.requests += 1
        await self.app(scope, receive, send)


def cross_run_attacks() -> tuple[int, int]:
    """(escapes, attacks) of a key of run X's rollout against run Y's proxy; prints one line each. Needs Django set
    up on a migrated database of its own (see main)."""
    import httpx
    from django.contrib.auth import get_user_model

    from proxy.app import create_app
    from proxy.server import ProxyServer
    from proxy.types import UpstreamConfig
    from runs import rollout_services
    from runs.models import ModelCall, Run, RunStatus
    from runs.recorder import DjangoRecorder, cached_directory

    users = get_user_model().objects
    attacker = Run.objects.create(owner=users.create_user("mallory"), name="x", model="m", status=RunStatus.RUNNING)
    victim = Run.objects.create(owner=users.create_user("victim"), name="y", model="m", status=RunStatus.RUNNING)
    mine, my_key = rollout_services.create_rollout(attacker, task=None, split="train", step=0, group=0, attempt=0)
    theirs, _ = rollout_services.create_rollout(victim, task=None, split="train", step=0, group=0, attempt=0)
    for rollout in (mine, theirs):
        rollout_services.start_rollout(rollout.pk)
    engine = _CountingEngine()
    app = create_app(cached_directory(victim.pk, ttl_s=0.1), DjangoRecorder(),
                     UpstreamConfig(base_url="http://engine/v1", served_model="victim-model"),
                     transport=httpx.ASGITransport(app=engine))
    server = ProxyServer(app, host="127.0.0.1").start()
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    calls = [("POST", "chat/completions", chat), ("POST", "completions", {"model": "m", "prompt": "hi"}),
             ("POST", "responses", {"model": "m", "input": "hi"}),
             ("POST", "messages", {"model": "m", "max_tokens": 8, "messages": chat["messages"]}),
             ("POST", "messages/count_tokens", {"model": "m", "messages": chat["messages"]}),
             ("GET", "models", None), ("POST", "reward", {"reward": 1.0}), ("POST", "embeddings", {"input": "hi"})]
    escapes = attacks = 0
    try:
        with httpx.Client(timeout=30) as http:
            for target, rollout_id in (("its own rollout id", mine.pk), ("the victim's rollout id", theirs.pk)):
                for method, path, body in calls:
                    attacks += 1
                    before = engine.requests
                    answer = http.request(method, server.base_url(str(rollout_id)) + "/" + path, json=body,
                                          headers={"Authorization": f"Bearer {my_key}", "x-api-key": my_key})
                    reached = engine.requests - before
                    escaped = answer.status_code < 400 or reached > 0
                    escapes += escaped
                    state = (f"ESCAPED: {answer.status_code}, {reached} request(s) reached the victim's engine"
                             if escaped else f"stopped ({answer.status_code})")
                    print(f"proxy    {'cross-run key, ' + target + ': ' + method + ' ' + path:55} {state}", flush=True)
    finally:
        server.stop()
    recorded = ModelCall.objects.count()
    if recorded:
        escapes += 1
        print(f"proxy    cross-run key: {recorded} call(s) recorded                ESCAPED", flush=True)
    return escapes, attacks


def _cross_run_main() -> None:
    """The --cross-run subprocess: a fresh SQLite data dir, migrated, then cross_run_attacks; prints its RESULT."""
    with tempfile.TemporaryDirectory(prefix="cross-run-") as tmp:
        os.environ.update(LIGHTNING_DATA_DIR=tmp, DATABASE_URL=f"sqlite:///{tmp}/db.sqlite3", DEBUG="0")
        import logging

        import django
        from django.core.management import call_command

        django.setup()
        logging.getLogger("httpx").setLevel(logging.WARNING)
        call_command("migrate", verbosity=0)
        escapes, attacks = cross_run_attacks()
        from django.db import connections

        connections.close_all()
    print(f"RESULT cross_run_key_escapes={escapes} cross_run_key_attacks={attacks}", flush=True)


def _cross_run() -> tuple[int, int]:
    """cross_run_attacks in a subprocess (its own database and settings): (escapes, attacks); a subprocess that
    printed no RESULT counts as one escape, so a broken check never reads as safe."""
    import subprocess

    done = subprocess.run([sys.executable, __file__, "--cross-run"], capture_output=True, text=True, timeout=600)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            figures = dict(item.split("=", 1) for item in line.split()[1:])
            return int(figures["cross_run_key_escapes"]), int(figures["cross_run_key_attacks"])
        print(line, flush=True)
    print(f"cross-run key attacks did not finish (exit {done.returncode}): {done.stderr[-2000:]}", flush=True)
    return 1, 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unisolated", action="store_true", help="without bubblewrap (LIGHTNING_UNSAFE_LOCAL_EXEC=1)")
    parser.add_argument("--cross-run", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cross_run:
        _cross_run_main()
        return
    import django

    django.setup()
    from django.conf import settings

    if args.unisolated:
        settings.LIGHTNING_BWRAP, settings.LIGHTNING_UNSAFE_LOCAL_EXEC = "/nonexistent/bwrap", True
    from sandbox import isolation
    from tests.isolation_attacks import ATTACKS, run_harness, run_reward, still_works, targets

    print(f"isolation: {isolation.current().describe()}")
    escapes = attacks = broken = 0
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="isolation-bench-") as tmp, targets(Path(tmp)) as ctx:
        for attack in ATTACKS:
            for verdict in (run_reward(attack, ctx), run_harness(attack, ctx, Path(tmp))):
                attacks += 1
                escapes += verdict.escaped is not None
                state = f"ESCAPED: {verdict.escaped[:200]}" if verdict.escaped else f"stopped ({verdict.detail[:120]})"
                print(f"{verdict.where:8} {attack.name:55} {state}", flush=True)
            if still_works(ctx, Path(tmp)) != (True, True):
                broken += 1
                print(f"after {attack.name!r}: the next score or attempt FAILED", flush=True)
    print(f"{attacks} attacks in {time.monotonic() - started:.1f} s; {broken} left the sandbox unusable")
    cross_escapes, cross_attacks = _cross_run()
    print(f"RESULT isolation_escapes={escapes} isolation_attacks={attacks} cross_run_key_escapes={cross_escapes} "
          f"cross_run_key_attacks={cross_attacks}")


if __name__ == "__main__":
    main()
