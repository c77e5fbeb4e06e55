"""Load through the recording proxy: concurrent harness subprocesses, every call recorded with its tokens.

The CI-sized run of bench/proxy_load.py (same code: run_load), against the real DjangoRecorder and database.
"""
from __future__ import annotations

from collections import Counter

import pytest

from bench._proxy_load_harness import API_OF, EPISODE_TURNS, KINDS, PAIRED
from bench.proxy_load import run_load
from runs.models import ModelCall, Rollout
from tests.proxy.fake_upstream import IM_END, encode, render_chat

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

HARNESSES, CALLS = 16, 20


def expected_apis() -> Counter:
    """The ModelCall.api of every call the harnesses make: harness i's turn t is KINDS[(t + i) % len(KINDS)]."""
    return Counter(API_OF[KINDS[(turn + i) % len(KINDS)]] for i in range(HARNESSES) for turn in range(CALLS))


def test_it_records_every_call_of_concurrent_harnesses_with_its_tokens(tmp_path):
    report = run_load(HARNESSES, CALLS, tmp_path, latency_s=0.05, chunk_delay_s=0.002, per_process=4)

    # What the harnesses saw: every call answered 200 with the fake engine's text, through the proxy and direct.
    proxied, direct = report.calls("proxy"), report.calls("direct")
    assert len(proxied) == report.sent == HARNESSES * CALLS
    assert len(direct) == sum(KINDS[(t + i) % len(KINDS)] in PAIRED for i in range(HARNESSES) for t in range(CALLS))
    assert report.failed == [] and report.server_errors == 0
    assert Counter(r["status"] for r in report.results) == {200: len(proxied) + len(direct)}

    # What the database holds: one row per call, in seq order per rollout, committed before the harness had its
    # answer (nothing was left to write when the last harness finished).
    assert report.recorded == report.sent and report.rows_at_end == report.sent and report.backlog_end == 0
    assert report.recorded_per_rollout == {pk: list(range(CALLS)) for pk in report.rollout_ids}
    assert report.recorded_apis == expected_apis() and report.recorded_statuses == {200: report.sent}
    assert report.recorded_errors == {}
    assert report.rows_with_tokens == report.sent and len(report.lags_ms) == report.sent
    assert list(Rollout.objects.filter(pk__in=report.rollout_ids).values_list("call_count", flat=True)) == \
        [CALLS] * HARNESSES

    rows = ModelCall.objects.filter(rollout_id__in=report.rollout_ids)
    assert rows.count() == HARNESSES * CALLS
    for row in rows.filter(api="chat"):
        content = row.response["choices"][0]["message"]["content"]
        assert row.status_code == 200 and row.error == "" and content.startswith("Hello! You said: ")
        assert row.prompt_ids == render_chat(row.request["messages"])
        assert row.completion_ids == encode(content) + [IM_END] and row.finish_reason == "stop"
        assert len(row.logprobs) == len(row.completion_ids)
    assert rows.filter(api="chat", stream=True).count() == sum(
        KINDS[(t + i) % len(KINDS)] == "chat_stream" for i in range(HARNESSES) for t in range(CALLS))
    for row in rows.exclude(api="chat"):
        assert row.status_code == 200 and row.prompt_ids and row.completion_ids[-1] == IM_END
        assert len(row.logprobs) == len(row.completion_ids)
    # Multi-turn: a conversation's later calls carry the earlier answers.
    last_turn = rows.get(rollout_id=report.rollout_ids[0], seq=EPISODE_TURNS - 1)
    assert len(last_turn.prompt_ids) > len(rows.get(rollout_id=report.rollout_ids[0], seq=0).prompt_ids)
