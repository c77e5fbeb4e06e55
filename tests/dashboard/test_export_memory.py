"""Exporting the 100k-call benchmark run (bench/seed_big_run.py) through the export page grows the process by under
150 MB at its peak: the rollouts stream from a server-side cursor, their calls and samples a batch at a time.

    flock /tmp/lw-heavy.lock env DATABASE_URL=postgresql://postgres@127.0.0.1:5432/lw .venv/bin/python -m pytest \
        -s -m slow tests/dashboard/test_export_memory.py      # -s prints the figures
"""
import ctypes
import gc
import time
import tracemalloc
from pathlib import Path

import pytest
from django.db import connection

from bench.seed_big_run import BIG, seed_big_run

pytestmark = [pytest.mark.slow, pytest.mark.django_db]
LIMIT_MB = 150
PAGE = 4096


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE


def peak_rss_bytes() -> int:
    """VmHWM: the highest resident size since the last reset_peak_rss()."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM starts again from the current RSS


def release_freed_memory() -> None:
    """Hand freed heap back to the system, so the seeding's garbage cannot hide the export's growth."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the RSS baseline is only less tight
        pass


def test_exporting_the_100k_call_run_grows_memory_by_under_150_mb(client):
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL only: the test database of SQLite lives in this process's memory, so the 3 GB the "
                    "100k-call run holds would be measured as the export's; set DATABASE_URL to a PostgreSQL server")
    user, run_id = seed_big_run()
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")  # what autovacuum does soon after a load
        cursor.execute("SELECT count(*) FROM runs_modelcall c JOIN runs_rollout r ON r.id = c.rollout_id "
                       "WHERE r.run_id = %s", [run_id])
        assert cursor.fetchone()[0] == BIG.rollouts * BIG.calls == 100_000
    client.force_login(user)
    release_freed_memory()
    baseline = rss_bytes()
    reset_peak_rss()
    tracemalloc.start()
    started = time.perf_counter()
    response = client.get(f"/runs/{run_id}/export.jsonl")
    assert response.status_code == 200 and response.streaming
    lines = calls = size = 0
    sampled_peak = baseline
    first = b""
    for piece in response.streaming_content:  # consumed and thrown away, as a client's download would be
        if not first:
            first = piece[:piece.index(b"\n")]
        lines += piece.count(b"\n")
        calls += piece.count(b'"seq":')  # pieces hold whole lines
        size += len(piece)
        sampled_peak = max(sampled_peak, rss_bytes())
    seconds = time.perf_counter() - started
    _, python_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss_growth = max(peak_rss_bytes(), sampled_peak) - baseline
    print(f"\nexport of run {run_id}: {lines} rollouts, {calls} calls, {size / 2**20:.0f} MB in {seconds:.0f} s; "
          f"peak RSS growth {rss_growth / 2**20:.1f} MB (baseline {baseline / 2**20:.0f} MB), "
          f"tracemalloc peak {python_peak / 2**20:.1f} MB; limit {LIMIT_MB} MB")
    assert lines == BIG.rollouts and calls == 100_000
    assert first.startswith(b'{"schema":"lightning-web/rollout-export","version":1,')
    assert rss_growth < LIMIT_MB * 2**20
    assert python_peak < LIMIT_MB * 2**20
