"""The rollouts export (GET /runs/<id>/export.jsonl and /api/v1/runs/<id>/export/): filtered as the rollouts table,
streamed JSONL with every call and sample as recorded, a fixed number of queries per batch of rollouts."""
import json

import pytest
import yaml
from django.db import connection, connections
from django.test import AsyncClient
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from dashboard import export
from runs import rollout_services
from runs.models import ModelCall, Rollout, Sample
from tests.dashboard.export_seed import chat_call, seed_export_run

pytestmark = pytest.mark.django_db


@pytest.fixture
def seeded(alice, make_run):
    return seed_export_run(alice, make_run)


def lines(response) -> list[dict]:
    assert response.streaming
    body = b"".join(response.streaming_content).decode()
    assert body.endswith("\n")
    return [json.loads(line) for line in body.splitlines()]


def test_it_streams_one_line_per_rollout_with_its_calls_and_samples(client, alice, seeded):
    run, rows = seeded
    client.force_login(alice)
    response = client.get(f"/runs/{run.pk}/export.jsonl")
    assert response.status_code == 200
    assert response["Content-Type"] == "application/jsonl; charset=utf-8"
    assert response["Content-Disposition"] == f'attachment; filename="run-{run.pk}-rollouts.jsonl"'
    records = lines(response)
    assert [r["rollout"]["id"] for r in records] == sorted(r.pk for r in rows.values())
    for record in records:
        assert record["schema"] == "lightning-web/rollout-export" and record["version"] == 1
        assert record["run"] == {"id": run.pk, "name": "run", "model": "tiny"}

    trained = next(r for r in records if r["rollout"]["id"] == rows["trained"].pk)
    rollout = trained["rollout"]
    assert {k: rollout[k] for k in ("split", "step", "batch_step", "trained_step", "group", "attempt", "status",
                                    "reward", "reward_detail", "failure_kind", "drop_reason", "exit_code",
                                    "call_count")} == {
        "split": "train", "step": 1, "batch_step": 1, "trained_step": 1, "group": 0, "attempt": 0, "status": "succeeded",
        "reward": 1.0, "reward_detail": {"reward": 1.0, "checked": True}, "failure_kind": "", "drop_reason": "",
        "exit_code": 0, "call_count": 2}
    assert rollout["task_id"] == "t1"
    assert rollout["task"] == {"id": "t1", "question": "1+1", "split": "train"}  # the answer is reward-only
    stored = Rollout.objects.get(pk=rows["trained"].pk)
    assert rollout["timings"] == {"created_at": stored.created_at.isoformat(),
                                  "started_at": stored.started_at.isoformat(),
                                  "finished_at": stored.finished_at.isoformat(),
                                  "duration_s": pytest.approx((stored.finished_at - stored.started_at).total_seconds())}

    calls = list(ModelCall.objects.filter(rollout_id=rows["trained"].pk).order_by("seq"))
    assert [c["seq"] for c in trained["calls"]] == [0, 1]
    for exported, call in zip(trained["calls"], calls):
        assert {k: exported[k] for k in ("api", "stream", "request", "response", "prompt_ids", "completion_ids",
                                         "logprobs", "finish_reason", "latency_ms", "policy_version", "drift",
                                         "status_code", "error")} == {
            "api": "chat", "stream": call.stream, "request": call.request, "response": call.response,
            "prompt_ids": call.prompt_ids, "completion_ids": call.completion_ids, "logprobs": call.logprobs,
            "finish_reason": call.finish_reason, "latency_ms": call.latency_ms,
            "policy_version": call.policy_version, "drift": call.drift, "status_code": 200, "error": ""}
    assert [c["drift"] for c in trained["calls"]] == ["clean", "realign"]
    assert trained["calls"][0]["response"]["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "python"
    assert trained["calls"][1]["request"]["messages"][3] == {"role": "tool", "tool_call_id": "call_0", "content": "2"}
    # The conversation in one shape whatever the API: the last call's context and its answer.
    last = trained["calls"][-1]
    assert [m["role"] for m in trained["messages"]] == [m["role"] for m in last["request"]["messages"]] + ["assistant"]
    tool_turn = trained["messages"][3]
    assert (tool_turn["role"], tool_turn["text"], tool_turn["tool_call_id"]) == ("tool", "2", "call_0")
    assert [c["name"] for c in trained["messages"][2]["tool_calls"]] == ["python"]
    assert [m["completion"] for m in trained["messages"]] == [False] * len(last["request"]["messages"]) + [True]

    assert trained["samples"] == [{
        "index": 0, "advantage": 0.75, "build": "merged", "step": 1, "policy_version": 1,
        "token_ids": [10, 11, 12, 20, 21, 30, 31], "loss_mask": [0, 0, 0, 1, 1, 0, 1],
        "logprobs": [0.0, 0.0, 0.0, -0.5, -0.25, 0.0, -1.25],
        "trainer_logprobs": [None, None, None, -0.5, -0.3, None, -1.0], "call_seqs": [0, 1],
        "spans": [[0, 0, 3, False], [0, 3, 5, True], [1, 5, 6, False], [1, 6, 7, True]]}]

    dropped = next(r for r in records if r["rollout"]["id"] == rows["dropped"].pk)
    assert dropped["rollout"]["drop_reason"] == "no_sampled_tokens" and dropped["samples"] == []
    assert (dropped["rollout"]["batch_step"], dropped["rollout"]["trained_step"]) == (1, None)  # sampled, not trained
    assert len(dropped["calls"]) == 1 and dropped["calls"][0]["response"]["choices"][0]["message"]["content"] == "3"
    failed = next(r for r in records if r["rollout"]["id"] == rows["failed"].pk)
    assert failed["calls"] == [] and failed["samples"] == [] and failed["rollout"]["reward"] is None
    assert failed["rollout"]["error"] == "engine <b>died</b>" and failed["rollout"]["failure_kind"] == "infra"
    assert failed["rollout"]["trained_step"] is None and failed["rollout"]["split"] == "val"


@pytest.mark.parametrize("query, expected", [
    ("split=val", ["failed"]),
    ("step=1", ["trained", "dropped"]),
    ("step=1&reward_min=0.5", ["trained"]),
    ("status=failed", ["failed"]),
    ("q=t2", ["dropped"]),
    ("q=died", ["failed"]),
    ("reward_max=0.5", ["dropped"]),
    ("sort=-reward&page=3&page_size=1", ["trained", "dropped", "failed"]),  # sort and page do not apply
])
def test_it_keeps_what_the_tables_filters_keep_in_id_order(client, alice, seeded, query, expected):
    run, rows = seeded
    client.force_login(alice)
    response = client.get(f"/runs/{run.pk}/export.jsonl?{query}")
    assert response.status_code == 200
    assert [r["rollout"]["id"] for r in lines(response)] == sorted(rows[name].pk for name in expected)


def test_a_filter_the_table_refuses_answers_400_with_the_reason(client, alice, seeded):
    run, _ = seeded
    client.force_login(alice)
    response = client.get(f"/runs/{run.pk}/export.jsonl?split=test")
    assert response.status_code == 400
    assert response.content.decode() == "split must be one of ['train', 'val'], got 'test'"
    response = client.get(f"/runs/{run.pk}/export.jsonl?reward_min=high")
    assert response.status_code == 400 and response.content.decode() == "reward_min must be a number, got 'high'"


def test_only_the_owner_exports(client, bob, seeded):
    run, _ = seeded
    assert client.get(f"/runs/{run.pk}/export.jsonl").status_code == 302  # to the login page
    client.force_login(bob)
    assert client.get(f"/runs/{run.pk}/export.jsonl").status_code == 404


def test_an_empty_selection_is_an_empty_file(client, alice, seeded):
    run, _ = seeded
    client.force_login(alice)
    response = client.get(f"/runs/{run.pk}/export.jsonl?step=9")
    assert response.status_code == 200 and b"".join(response.streaming_content) == b""


def test_the_run_page_has_the_export_button(client, alice, seeded):
    run, _ = seeded
    client.force_login(alice)
    html = client.get(f"/runs/{run.pk}/").content.decode()
    assert f'id="export-rollouts" href="/runs/{run.pk}/export.jsonl"' in html


def test_the_queries_are_two_per_batch_of_rollouts_never_one_per_rollout(client, alice, make_run, monkeypatch):
    run = make_run(alice)
    rollouts = [rollout_services.create_rollout(run, task=None, split="train", step=1, group=i, attempt=0)[0]
                for i in range(7)]
    rollout_services.record_calls([chat_call(r.pk, seq, "2") for r in rollouts for seq in range(2)])
    client.force_login(alice)

    def queries(batch):
        monkeypatch.setattr(export, "BATCH", batch)
        with CaptureQueriesContext(connection) as captured:
            records = lines(client.get(f"/runs/{run.pk}/export.jsonl"))
        assert [len(r["calls"]) for r in records] == [2] * 7
        return [q["sql"] for q in captured if "runs_modelcall" in q["sql"] or "runs_sample" in q["sql"]]

    assert len(queries(200)) == 2  # one batch: its calls, its samples
    assert len(queries(3)) == 6  # three batches (3, 3, 1 rollouts)


def test_read_export_reads_the_records_back(client, alice, seeded, tmp_path):
    run, rows = seeded
    client.force_login(alice)
    path = tmp_path / "export.jsonl"
    path.write_bytes(b"".join(client.get(f"/runs/{run.pk}/export.jsonl").streaming_content))
    records = list(export.read_export(path))
    assert [r["rollout"]["id"] for r in records] == sorted(r.pk for r in rows.values())
    assert records[0]["samples"][0]["token_ids"] == Sample.objects.get(rollout=rows["trained"]).token_ids
    path.write_text(path.read_text() + '{"id": "t9", "question": "2+2"}\n')
    with pytest.raises(ValueError, match=r"export.jsonl:4: not a rollouts export record"):
        list(export.read_export(path))


# ---- the API ---------------------------------------------------------------------------------------------------

def test_the_api_streams_the_same_export_with_a_token(client, alice, alice_api, seeded):
    run, _ = seeded
    client.force_login(alice)
    page = b"".join(client.get(f"/runs/{run.pk}/export.jsonl?step=1").streaming_content)
    assert reverse("run-export-api", args=[run.pk]) == f"/api/v1/runs/{run.pk}/export/"
    assert reverse("run-export", args=[run.pk]) == f"/runs/{run.pk}/export.jsonl"
    response = alice_api.get(f"/api/v1/runs/{run.pk}/export/?step=1")
    assert response.status_code == 200
    assert response["Content-Disposition"] == f'attachment; filename="run-{run.pk}-rollouts.jsonl"'
    assert b"".join(response.streaming_content) == page and page.count(b"\n") == 2
    # status is a rollout filter here, not the runs list's run-status filter
    response = alice_api.get(f"/api/v1/runs/{run.pk}/export/?status=failed", HTTP_ACCEPT="application/jsonl")
    assert response.status_code == 200 and [r["rollout"]["status"] for r in lines(response)] == ["failed"]


def test_the_api_takes_a_session_too(client, alice, seeded):
    run, _ = seeded
    client.force_login(alice)
    response = client.get(f"/api/v1/runs/{run.pk}/export/?split=val")
    assert response.status_code == 200 and len(lines(response)) == 1


def test_the_api_refuses_a_bad_filter_and_other_users(alice_api, bob_api, client, seeded):
    run, _ = seeded
    response = alice_api.get(f"/api/v1/runs/{run.pk}/export/?step=-1")
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "step must be at least 0, got '-1'"
    assert bob_api.get(f"/api/v1/runs/{run.pk}/export/").status_code == 404
    assert client.get(f"/api/v1/runs/{run.pk}/export/").status_code in (401, 403)


def test_the_api_schema_documents_the_export(client, alice):
    client.force_login(alice)
    schema = yaml.safe_load(client.get("/api/schema/").content)
    operation = schema["paths"]["/api/v1/runs/{id}/export/"]["get"]
    assert {p["name"] for p in operation["parameters"]} >= {"id", "step", "split", "status", "reward_min",
                                                            "reward_max", "q"}
    assert "application/jsonl" in operation["responses"]["200"]["content"]


# ---- under ASGI: an async iterator, or Django would collect the whole export before sending it ------------------

@pytest.mark.django_db(transaction=True)
async def test_under_asgi_it_streams_through_an_async_iterator(alice, make_run):
    from asgiref.sync import sync_to_async

    run, rows = await sync_to_async(seed_export_run)(alice, make_run)
    client = AsyncClient()
    await client.aforce_login(alice)
    response = await client.get(f"/runs/{run.pk}/export.jsonl")
    assert response.status_code == 200 and response.is_async
    body = b"".join([piece async for piece in response.streaming_content])
    records = [json.loads(line) for line in body.decode().splitlines()]
    assert [r["rollout"]["id"] for r in records] == sorted(r.pk for r in rows.values())
    assert records[0]["samples"][0]["loss_mask"] == [0, 0, 0, 1, 1, 0, 1]
    await sync_to_async(connections.close_all)()  # the export thread's connection (the test client keeps it open)
