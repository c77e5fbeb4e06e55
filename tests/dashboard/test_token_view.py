"""The token view of a sample (/samples/<id>/tokens/) and its JSON chunks: marks, texts, spans, owner only, queries."""
import json
import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from catalog import tokenizers
from proxy.types import RecordedCall
from runs import rollout_services
from runs.models import ModelCall, Run, Sample
from tests.catalog.test_tokenizers import tiny_tokenizer_dir  # noqa: F401  (a fixture)
from trainer.samples import CallRecord, build_samples

pytestmark = pytest.mark.django_db

USER_1 = "<|im_start|>user\nWhat is 2 + 3? 世界 <b>bold</b><|im_end|>\n<|im_start|>assistant\n"
ANSWER_1 = "CALC: 2 + 3<|im_end|>"
USER_2 = "\n<|im_start|>user\nRESULT: 5<|im_end|>\n<|im_start|>assistant\n"
ANSWER_2 = "ANSWER: 5<|im_end|>"


@pytest.fixture(autouse=True)
def empty_caches():
    tokenizers.clear_caches()
    yield
    tokenizers.clear_caches()


@pytest.fixture
def tokenizer(tiny_tokenizer_dir):  # noqa: F811
    return tokenizers.load_tokenizer(str(tiny_tokenizer_dir)).tokenizer


@pytest.fixture
def make_sample(alice, make_run, tiny_tokenizer_dir, tokenizer):  # noqa: F811
    """Record a rollout's two calls (the second realigns: its prompt re-tokenizes the first answer) and the sample
    the trainer builds from them, as runs.orchestrator stores it (spans, trainer logprobs, step)."""
    def make(owner=None, spans=True, trainer=True, answer_repeat=1):
        run = make_run(owner or alice, name=f"run{Run.objects.count()}")
        Run.objects.filter(pk=run.pk).update(model_info={"name": "tiny", "path": str(tiny_tokenizer_dir)})
        rollout, _ = rollout_services.create_rollout(run, task=None, split="train", step=1, group=0, attempt=0)
        prompt_1 = tokenizer.encode(USER_1)
        body = ANSWER_1.removesuffix("<|im_end|>") * answer_repeat
        answer_1 = [i for ch in body for i in tokenizer.encode(ch)] + tokenizer.encode("<|im_end|>")
        prompt_2 = tokenizer.encode(USER_1 + body + "<|im_end|>" + USER_2)
        answer_2 = tokenizer.encode(ANSWER_2)
        calls = [(0, prompt_1, answer_1), (1, prompt_2, answer_2)]
        rollout_services.record_calls([RecordedCall(
            rollout_id=str(rollout.pk), seq=seq, api="chat", request={"messages": [{"role": "user", "content": "x"}]},
            response={}, upstream_request={}, prompt_ids=p, completion_ids=c,
            logprobs=[-0.05 * (k + 1) for k in range(len(c))], finish_reason="stop", status_code=200, latency_ms=5.0,
            policy_version=0, error=None, stream=False, started_at=0.0) for seq, p, c in calls])
        built = build_samples([CallRecord(seq, tuple(p), tuple(c), tuple(-0.05 * (k + 1) for k in range(len(c))))
                               for seq, p, c in calls], tokenizer.decode)
        sample, = built.samples
        row = {"rollout_id": rollout.pk, "token_ids": list(sample.token_ids), "loss_mask": list(sample.loss_mask),
               "logprobs": list(sample.logprobs), "advantage": 0.75, "call_seqs": list(sample.call_seqs),
               "trainer_logprobs": [lp - 0.01 * (i % 3) if m else None
                                    for i, (lp, m) in enumerate(zip(sample.logprobs, sample.loss_mask))]
               if trainer else [],
               "spans": [[s.call_seq, s.start, s.end, s.sampled] for s in sample.spans] if spans else [],
               "build": sample.build, "step": 1, "policy_version": 0}
        rollout_services.record_step(run.pk, 1, 1, [row], {rollout.pk: built.drift}, {}, {rollout.pk: ""})
        return Sample.objects.get(rollout=rollout)

    return make


def page_config(html: str) -> dict:
    found = re.search(r'<script id="token-view-config" type="application/json">(.*?)</script>', html, re.S)
    return json.loads(found.group(1))


def all_tokens(client, sample_id: int, count: int) -> list[dict]:
    tokens, start = [], 0
    while True:
        response = client.get(f"/samples/{sample_id}/tokens.json", {"start": start, "count": count})
        assert response.status_code == 200
        data = response.json()
        assert data["start"] == start and data["count"] == len(data["tokens"]) <= count
        if not data["tokens"]:
            return tokens
        tokens += data["tokens"]
        start += data["count"]


def test_it_marks_trained_tokens_exactly_where_the_loss_mask_is_1(client, alice, make_sample, tokenizer):
    sample = make_sample()
    client.force_login(alice)
    tokens = all_tokens(client, sample.pk, count=7)
    stored = Sample.objects.get(pk=sample.pk)
    assert [t["i"] for t in tokens] == list(range(len(stored.token_ids)))
    assert [t["id"] for t in tokens] == stored.token_ids
    assert [t["mask"] for t in tokens] == stored.loss_mask and 0 < sum(stored.loss_mask) < len(stored.loss_mask)
    assert "".join(t["text"] for t in tokens) == tokenizer.decode(stored.token_ids)
    for t in tokens:
        if t["mask"]:
            assert t["lp"] == stored.logprobs[t["i"]]
            assert t["tlp"] == pytest.approx(stored.logprobs[t["i"]] - 0.01 * (t["i"] % 3))
            assert t["mismatch"] == pytest.approx(0.01 * (t["i"] % 3))
        else:
            assert t["lp"] is None and t["tlp"] is None and t["mismatch"] is None


def test_the_page_shows_the_facts_the_call_spans_and_only_the_first_chunk(client, alice, make_sample):
    sample = make_sample()
    client.force_login(alice)
    response = client.get(f"/samples/{sample.pk}/tokens/")
    html = response.content.decode()
    assert response.status_code == 200
    config = page_config(html)
    assert config["spans"] == sample.spans and [s[0] for s in sample.spans] == [0, 0, 1, 1]
    assert config["drift"] == {"0": "clean", "1": "realign"}
    assert config["total"] == len(sample.token_ids) and config["tokenizer"] is True and config["trainer"] is True
    assert [t["mask"] for t in config["first"]] == sample.loss_mask  # shorter than one chunk: all of it
    assert config["data_url"] == f"/samples/{sample.pk}/tokens.json"
    facts = html[html.index('id="sample-facts"'):html.index("</dl>")]
    assert '<dd id="sample-advantage">0.7500</dd>' in facts and '<dd id="sample-build">realigned</dd>' in facts
    assert "clean ×1" in facts and "realign ×1" in facts and '<dd id="sample-step">1</dd>' in facts
    trained = sum(sample.loss_mask)
    assert f'<span id="count-trained">{trained}</span>' in facts
    assert f'<span id="count-context">{len(sample.token_ids) - trained}</span>' in facts
    assert 'data-seq="0"' in html and 'data-seq="1"' in html and '<option value="mismatch">' in html
    assert f'data-total="{len(sample.token_ids)}" data-rendered="0"' in html
    assert "<b>bold</b>" not in html  # token text travels as escaped JSON only
    assert "css/tokens.css" in html and "js/pages/sample_tokens.js" in html


def test_a_sample_recorded_before_spans_gets_them_rebuilt_from_its_calls(client, alice, make_sample):
    recorded = make_sample()
    old = make_sample(spans=False, trainer=False)
    assert old.spans == [] and old.trainer_logprobs == []
    client.force_login(alice)
    html = client.get(f"/samples/{old.pk}/tokens/").content.decode()
    config = page_config(html)
    assert config["spans"] == recorded.spans and config["trainer"] is False
    assert 'id="spans-recomputed"' in html and '<option value="mismatch">' not in html
    assert all(t["tlp"] is None for t in config["first"])


def test_a_sample_whose_calls_do_not_rebuild_it_says_so(client, alice, make_sample):
    old = make_sample(spans=False)
    ModelCall.objects.filter(rollout_id=old.rollout_id, seq=1).update(completion_ids=[5], logprobs=[-1.0])
    client.force_login(alice)
    html = client.get(f"/samples/{old.pk}/tokens/").content.decode()
    assert page_config(html)["spans"] == [] and 'id="spans-note"' in html and "call boundaries unknown" in html


def test_only_the_owner_sees_a_sample(client, alice, bob, staff, make_sample):
    sample = make_sample()
    for url in (f"/samples/{sample.pk}/tokens/", f"/samples/{sample.pk}/tokens.json"):
        assert client.get(url).status_code == 302  # to the login page
        client.force_login(bob)
        assert client.get(url).status_code == 404
        client.force_login(staff)
        assert client.get(url).status_code == 200
        client.logout()
    client.force_login(alice)
    assert client.get("/samples/999999/tokens/").status_code == 404


def test_a_missing_model_folder_still_shows_the_ids(client, alice, make_sample, tmp_path):
    sample = make_sample()
    Run.objects.filter(pk=sample.rollout.run_id).update(model_info={"name": "tiny", "path": str(tmp_path / "gone")})
    client.force_login(alice)
    response = client.get(f"/samples/{sample.pk}/tokens/")
    html = response.content.decode()
    assert response.status_code == 200
    assert f"The model folder {tmp_path / 'gone'} is gone: showing token ids only." in html
    config = page_config(html)
    assert config["tokenizer"] is False
    assert [t["id"] for t in config["first"]] == sample.token_ids and all(t["text"] is None for t in config["first"])
    data = client.get(f"/samples/{sample.pk}/tokens.json").json()
    assert data["tokenizer"] is False and "gone" in data["note"] and data["tokens"][0]["id"] == sample.token_ids[0]


def test_it_rejects_bad_chunk_bounds(client, alice, make_sample):
    sample = make_sample()
    client.force_login(alice)
    for query in ({"start": "x"}, {"start": -1}, {"count": 0}, {"count": 100_000}):
        response = client.get(f"/samples/{sample.pk}/tokens.json", query)
        assert response.status_code == 400 and "count" in response.json()["error"]
    assert client.get(f"/samples/{sample.pk}/tokens.json", {"start": 10_000}).json()["tokens"] == []


def test_a_long_sample_sends_one_chunk_with_the_page(client, alice, make_sample):
    sample = make_sample(answer_repeat=300)  # about 3,600 tokens
    assert len(sample.token_ids) > 3000
    client.force_login(alice)
    config = page_config(client.get(f"/samples/{sample.pk}/tokens/").content.decode())
    assert len(config["first"]) == 2048 and config["chunk"] == 4096
    rest = client.get(config["data_url"], {"start": 2048, "count": config["chunk"]}).json()
    assert [t["i"] for t in rest["tokens"]] == list(range(2048, len(sample.token_ids)))
    texts = [t["text"] for t in config["first"] + rest["tokens"]]
    assert texts == tokenizers.token_texts(tokenizers.load_tokenizer(sample.rollout.run.model_info["path"]).tokenizer,
                                           sample.token_ids)


def count_queries(client, url):
    with CaptureQueriesContext(connection) as queries:
        assert client.get(url).status_code == 200
    return queries.captured_queries


@pytest.mark.parametrize("spans", [True, False])
def test_pages_cost_the_same_queries_for_a_long_sample_and_read_no_call_bodies(client, alice, make_sample, spans):
    small, big = make_sample(spans=spans), make_sample(spans=spans, answer_repeat=300)
    client.force_login(alice)
    for address in ("/samples/{}/tokens/", "/samples/{}/tokens.json?start=100&count=50"):
        small_queries = count_queries(client, address.format(small.pk))
        big_queries = count_queries(client, address.format(big.pk))
        assert len(small_queries) == len(big_queries)
        call_reads = [q["sql"] for q in big_queries if 'from "runs_modelcall"' in q["sql"].lower()]
        assert len(call_reads) == (1 if "tokens/" in address else 0)
        assert all('"request"' not in sql and '"response"' not in sql for sql in call_reads)
        sample_reads = [q["sql"] for q in big_queries if 'from "runs_sample"' in q["sql"].lower()]
        assert len(sample_reads) == 1 and "dataset_snapshot" not in sample_reads[0]
