"""Dataset pages: upload (every bad line listed, nothing saved), the dataset page and its task browser, delete."""
import json

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from catalog import services as catalog_services
from catalog.models import Dataset, Task
from catalog.pages.datasets import TASKS_PER_PAGE, json_chunks
from common import errors as common_errors

pytestmark = pytest.mark.django_db


def jsonl(tasks) -> bytes:
    return "\n".join(json.dumps(t) for t in tasks).encode()


def upload(client, content: bytes, filename="tasks.jsonl", **fields):
    data = {"name": "arith", "description": "sums", "split_by": "ratio", "val_ratio": "0.25", "seed": "3",
            "split_field": "", "hidden_fields": "", "required_fields": "", **fields}
    data["file"] = SimpleUploadedFile(filename, content)
    return client.post("/datasets/upload/", data)


@pytest.fixture
def alice_client(client, alice):
    client.force_login(alice)
    return client


def test_it_requires_login(client, alice, make_dataset):
    dataset = make_dataset(alice)
    for url in ("/datasets/", "/datasets/upload/", f"/datasets/{dataset.pk}/"):
        response = client.get(url)
        assert response.status_code == 302 and response.url.startswith("/accounts/login/")


def test_it_lists_own_datasets_with_counts_and_runs(alice_client, alice, bob, make_dataset, make_run):
    make_dataset(alice, name="<b>mine</b>")
    make_dataset(bob, name="bobs")
    run = make_run(alice, name="r")  # makes and uses dataset "r-d"
    response = alice_client.get("/datasets/")
    page = response.content.decode()
    assert response.status_code == 200
    assert "&lt;b&gt;mine&lt;/b&gt;" in page and "<b>mine</b>" not in page and "bobs" not in page
    row = page[page.index(f'data-dataset="{run.dataset_id}"'):]
    row = row[:row.index("</tr>")]
    assert [cell.split("<")[0] for cell in row.split('<td class="num">')[1:]] == ["4", "1", "1", "1"]


def test_it_uploads_with_val_ratio_and_hidden_fields(alice_client, alice):
    tasks = [{"id": f"t{i}", "q": f"{i}+1", "answer": i + 1, "gold": "x"} for i in range(40)]
    response = upload(alice_client, jsonl(tasks), hidden_fields="gold, notes")
    dataset = Dataset.objects.get(owner=alice, name="arith")
    assert response.status_code == 302 and response.url == f"/datasets/{dataset.pk}/"
    assert dataset.train_count + dataset.val_count == 40 and 0 < dataset.val_count < 40
    assert (dataset.val_ratio, dataset.seed, dataset.split_field) == (0.25, 3, "")
    assert dataset.hidden_fields == ["gold", "notes"] and dataset.source_filename == "tasks.jsonl"
    assert Task.objects.filter(dataset=dataset, split="val").count() == dataset.val_count
    page = alice_client.get(response.url).content.decode()
    assert f'<dd id="train-count">{dataset.train_count}</dd>' in page
    assert f'<dd id="val-count">{dataset.val_count}</dd>' in page
    assert "val share 0.25, seed 3" in page and dataset.content_sha256 in page
    assert '<code class="reward-only-name">gold</code>' in page and "uploaded: " in page  # the flash message


def test_it_uploads_a_json_array_split_by_field(alice_client, alice):
    tasks = [{"q": i, "part": "val" if i % 4 == 0 else "train"} for i in range(8)]
    response = upload(alice_client, json.dumps(tasks, indent=1).encode(), filename="tasks.json",
                      split_by="field", split_field="part", val_ratio="0.9")
    dataset = Dataset.objects.get(owner=alice)
    assert response.status_code == 302
    assert (dataset.train_count, dataset.val_count, dataset.split_field, dataset.val_ratio) == (6, 2, "part", 0.0)
    assert "by the field <code>part</code>" in alice_client.get(response.url).content.decode()


def test_split_by_field_needs_the_field_name(alice_client):
    response = upload(alice_client, jsonl([{"q": 1}]), split_by="field", split_field="")
    assert response.status_code == 200
    assert 'id="id_split_field_error"><span>name the field that holds train or val</span>' in response.content.decode()
    assert Dataset.objects.count() == 0


def test_a_bad_file_lists_every_bad_line_and_saves_nothing(alice_client, alice, make_dataset):
    make_dataset(alice, name="existing")
    datasets, tasks = Dataset.objects.count(), Task.objects.count()
    content = b'{"id": "a", "q": 1}\n{"id": "b", "q": \n[1, 2]\n{"id": "a", "q": 4}\n\n{"q": "<script>x</script>"\n'
    response = upload(alice_client, content, name="broken <name>", description="kept text", val_ratio="0.5")
    page = response.content.decode()
    assert response.status_code == 200
    assert (Dataset.objects.count(), Task.objects.count()) == (datasets, tasks)
    assert "4 bad lines" in page
    items = page[page.index('<div class="line-errors"'):page.index("</ol>")]
    assert items.count("<li ") == 4
    for line, text in ((2, "invalid JSON: Expecting value at column 18"), (3, "expected a JSON object, got an array"),
                       (4, "duplicate id &#x27;a&#x27; (first seen on line 1)"), (6, "invalid JSON")):
        assert f'<li data-line="{line}"><span class="line-no">line {line}</span>: {text}' in items
    assert "<script>x" not in page
    # the other fields stay filled
    assert 'value="broken &lt;name&gt;"' in page and ">\nkept text</textarea>" in page and 'value="0.5"' in page


def test_an_empty_file_is_refused(alice_client):
    response = upload(alice_client, b"")
    assert response.status_code == 200 and "the file is empty" in response.content.decode()
    assert Dataset.objects.count() == 0


def test_a_file_over_the_size_limit_is_refused_with_the_limit(alice_client, settings):
    settings.LIGHTNING_DATASET_MAX_BYTES = 1024
    response = upload(alice_client, jsonl([{"q": "x" * 100}] * 20))
    page = response.content.decode()
    assert response.status_code == 200 and "over the limit of 1.0\xa0KB (1024 bytes" in page
    assert Dataset.objects.count() == 0


def test_a_line_over_the_line_limit_is_listed(alice_client, settings):
    settings.LIGHTNING_DATASET_MAX_LINE_BYTES = 100
    response = upload(alice_client, jsonl([{"q": 1}, {"q": "y" * 200}]))
    assert response.status_code == 200
    assert "line 2</span>: line is 209 bytes, over the limit of 100 bytes" in response.content.decode()


def test_a_duplicate_name_is_a_field_error(alice_client, alice, bob, make_dataset):
    make_dataset(alice, name="arith")
    make_dataset(bob, name="taken-by-bob")
    response = upload(alice_client, jsonl([{"q": 1}]))
    assert response.status_code == 200
    assert "id_name_error\"><span>you already have a dataset named &#x27;arith&#x27;" in response.content.decode()
    assert Dataset.objects.filter(owner=alice).count() == 1
    assert upload(alice_client, jsonl([{"q": 1}]), name="taken-by-bob").status_code == 302  # names are per owner


def test_bad_hidden_fields_are_a_field_error(alice_client):
    response = upload(alice_client, jsonl([{"q": 1}]), hidden_fields='["ok", 3]')
    assert response.status_code == 200 and "every field name must be a non-empty string" in response.content.decode()
    assert Dataset.objects.count() == 0


def test_another_users_dataset_is_not_found(alice_client, bob, make_dataset):
    dataset = make_dataset(bob)
    assert alice_client.get(f"/datasets/{dataset.pk}/").status_code == 404
    assert alice_client.post(f"/datasets/{dataset.pk}/delete/").status_code == 404
    assert Dataset.objects.filter(pk=dataset.pk).exists()


def test_staff_see_every_dataset(client, staff, bob, make_dataset):
    dataset = make_dataset(bob, name="bobs")
    client.force_login(staff)
    assert "bobs" in client.get("/datasets/").content.decode()
    assert client.get(f"/datasets/{dataset.pk}/").status_code == 200


@pytest.fixture
def big(alice, make_dataset):
    tasks = [{"id": f"task-{i:03d}", "question": f"what is {i} + 1?", "answer": i + 1,
              "split": "val" if i % 10 == 0 else "train"} for i in range(120)]
    tasks[57]["question"] = "a needle <in> the haystack"
    return make_dataset(alice, name="big", tasks=tasks)


def ids(page: str) -> list[str]:
    return [chunk.split('"', 1)[0] for chunk in page.split('data-external-id="')[1:]]


def test_the_task_browser_pages_in_file_order(alice_client, big):
    page = alice_client.get(f"/datasets/{big.pk}/").content.decode()
    assert ids(page) == [f"task-{i:03d}" for i in range(TASKS_PER_PAGE)]
    assert "120 tasks" in page and "page 1 of 5" in page
    assert 'href="?page=2"' in page and 'aria-current="page">1<' in page
    page = alice_client.get(f"/datasets/{big.pk}/?page=3").content.decode()
    assert ids(page) == [f"task-{i:03d}" for i in range(50, 75)]
    assert ids(alice_client.get(f"/datasets/{big.pk}/?page=999").content.decode())[-1] == "task-119"
    assert ids(alice_client.get(f"/datasets/{big.pk}/?page=x").content.decode())[0] == "task-000"


def test_the_task_browser_filters_by_split_and_keeps_the_filter_in_page_links(alice_client, big):
    page = alice_client.get(f"/datasets/{big.pk}/?split=val").content.decode()
    assert ids(page) == [f"task-{i:03d}" for i in range(0, 120, 10)] and "12 tasks match" in page
    page = alice_client.get(f"/datasets/{big.pk}/?split=train&page=2").content.decode()
    assert ids(page)[0] == "task-028" and 'href="?split=train&amp;page=1"' in page


def test_the_task_browser_searches_ids_and_task_text(alice_client, big):
    page = alice_client.get(f"/datasets/{big.pk}/", {"q": "NEEDLE <IN>"}).content.decode()
    assert ids(page) == ["task-057"] and "1 task matches" in page
    assert "a needle &lt;in&gt; the haystack" in page and "<in>" not in page.split('id="tasks"')[1]
    assert ids(alice_client.get(f"/datasets/{big.pk}/", {"q": "task-11"}).content.decode()) == [
        f"task-{i}" for i in range(110, 120)]
    assert ids(alice_client.get(f"/datasets/{big.pk}/", {"q": "what is 42 +", "split": "val"}).content.decode()) == []
    assert ids(alice_client.get(f"/datasets/{big.pk}/", {"q": "what is 40 +", "split": "val"}).content.decode()) == [
        "task-040"]
    page = alice_client.get(f"/datasets/{big.pk}/", {"q": "nothing like this"}).content.decode()
    assert 'id="no-tasks"' in page and "0 tasks match" in page


def test_the_task_browser_marks_reward_only_fields(alice_client, alice, make_dataset):
    dataset = make_dataset(alice, tasks=[{"id": "x", "question": "<q>", "answer": 2, "gold": {"a": [1]}}],
                           hidden_fields=["gold"])
    page = alice_client.get(f"/datasets/{dataset.pk}/").content.decode()
    pre = page[page.index('<pre class="task-json">'):page.index("</pre>")]
    assert '\n  &quot;question&quot;: &quot;&lt;q&gt;&quot;' in pre  # jsonb (PostgreSQL) may reorder keys
    assert '<mark class="reward-only" title="reward-only: never shown to a harness">  &quot;answer&quot;: 2</mark>' in pre
    assert 'reward-only: answer, gold' in page


def test_json_chunks_join_to_the_pretty_json():
    data = {"a": [1, {"b": "ü"}], "answer": {"x": 1}, "c": None}
    chunks = json_chunks(data, {"answer"})
    assert "".join(c.text for c in chunks) == json.dumps(data, indent=2, ensure_ascii=False)
    assert [c.text for c in chunks if c.reward_only] == ['  "answer": {\n    "x": 1\n  }']
    assert "".join(c.text for c in json_chunks({}, set())) == "{}"


def test_the_dataset_page_query_count_does_not_grow_with_tasks(alice_client, alice, make_dataset):
    small = make_dataset(alice, name="small", tasks=[{"q": i} for i in range(3)])
    large = make_dataset(alice, name="large", tasks=[{"q": i} for i in range(300)])
    counts = []
    for dataset in (small, large):
        with CaptureQueriesContext(connection) as queries:
            assert alice_client.get(f"/datasets/{dataset.pk}/", {"q": "q"}).status_code == 200
        counts.append(len(queries))
    assert counts[0] == counts[1]
    task_reads = [q["sql"] for q in queries.captured_queries if q["sql"].startswith('SELECT "runs_task"."id"')]
    assert len(task_reads) == 1 and "LIMIT 25" in task_reads[0]  # one page of tasks, never all of them


def test_delete_an_unused_dataset(alice_client, alice, make_dataset):
    dataset = make_dataset(alice)
    response = alice_client.post(f"/datasets/{dataset.pk}/delete/")
    assert response.status_code == 302 and response.url == "/datasets/"
    assert not Dataset.objects.filter(pk=dataset.pk).exists() and not Task.objects.filter(dataset_id=dataset.pk).exists()
    assert "deleted" in alice_client.get("/datasets/").content.decode()
    assert alice_client.get(f"/datasets/{dataset.pk}/delete/").status_code == 405


def test_a_dataset_a_run_uses_is_not_deleted(alice_client, alice, make_run):
    run = make_run(alice)
    response = alice_client.post(f"/datasets/{run.dataset_id}/delete/", follow=True)
    page = response.content.decode()
    assert response.status_code == 200
    assert f"Not deleted: dataset &#x27;run-d&#x27; is used by run(s) #{run.pk}; delete those runs first" in page
    assert Dataset.objects.filter(pk=run.dataset_id).exists() and Task.objects.filter(dataset_id=run.dataset_id).count() == 5


def test_delete_dataset_service_checks_the_owner(alice, bob, make_dataset):
    dataset = make_dataset(alice)
    with pytest.raises(common_errors.NotOwned):
        catalog_services.delete_dataset(dataset, bob)
    assert Dataset.objects.filter(pk=dataset.pk).exists()


def test_csrf_is_enforced_on_upload_and_delete(alice, make_dataset):
    client = Client(enforce_csrf_checks=True)
    client.force_login(alice)
    dataset = make_dataset(alice)
    assert upload(client, jsonl([{"q": 1}]), name="new").status_code == 403
    assert client.post(f"/datasets/{dataset.pk}/delete/").status_code == 403
    assert Dataset.objects.count() == 1
    form = client.get("/datasets/upload/")
    token = form.cookies["csrftoken"].value
    assert 'name="csrfmiddlewaretoken"' in form.content.decode()
    assert upload(client, jsonl([{"q": 1}]), name="new", csrfmiddlewaretoken=token).status_code == 302
    assert Dataset.objects.filter(name="new").exists()


def test_a_file_with_hundreds_of_bad_lines_lists_the_first_200(alice_client):
    response = upload(alice_client, b"not json\n" * 250)
    page = response.content.decode()
    assert response.status_code == 200 and "200 bad lines</strong> (the first 200 shown)" in page
    assert page.count('<span class="line-no">') == 200 and '<li data-line="200">' in page
    assert Dataset.objects.count() == 0 and Task.objects.count() == 0
