"""Every attack of tests/isolation_attacks.py through the real sandboxes, as a reward script and as a harness.

Prints one line per attack and place, then `RESULT isolation_escapes=<n> isolation_attacks=<m>`. With --unisolated
it runs them with bubblewrap made unavailable and LIGHTNING_UNSAFE_LOCAL_EXEC=1, to show what the attacks reach
without it (the escapes then are the point; never do this on a machine with real secrets).

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unisolated", action="store_true", help="without bubblewrap (LIGHTNING_UNSAFE_LOCAL_EXEC=1)")
    args = parser.parse_args()
    import django

    django.setup()
    from django.conf import settings

    if args.unisolated:
        settings.LIGHTNING_BWRAP, settings.LIGHTNING_UNSAFE_LOCAL_EXEC = "/nonexistent/bwrap", True
    from runs import isolation
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
    print(f"RESULT isolation_escapes={escapes} isolation_attacks={attacks}")


if __name__ == "__main__":
    main()
