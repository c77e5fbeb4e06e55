"""POST/GET /api/v1/datasets/ and /api/v1/tasks/: uploads validated line by line, nothing saved on error."""
import io
import json

import pytest

from catalog import services as catalog_services
from catalog.models import Dataset, Task
from common.errors import ServiceError

pytestmark = pytest.mark.django_db
URL = "/api/v1/datasets/"


def upload(client, name, content, filename="tasks.jsonl", **fields):
    file = io.BytesIO(content if isinstance(content, bytes) else content.encode())
    file.name = filename
    return client.post(URL, {"name": name, "file": file, **fields}, format="multipart")


def jsonl(*objs):
    return "\n".join(o if isinstance(o, str) else json.dumps(o) for o in objs) + "\n"


def test_it_uploads_jsonl_with_explicit_splits(alice_api, alice):
    response = upload(alice_api, "math", jsonl({"id": "a", "q": 1, "split": "train"}, {"id": "b", "q": 2, "split": "val"},
                                                {"id": 7, "q": 3, "split": "train"}))
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["name"] == "math" and body["train_count"] == 2 and body["val_count"] == 1
    assert len(body["content_sha256"]) == 64 and body["source_filename"] == "tasks.jsonl"
    dataset = Dataset.objects.get(pk=body["id"])
    assert dataset.owner == alice
    assert list(dataset.tasks.values_list("index", "external_id", "split", "data__q")) == [
        (0, "a", "train", 1), (1, "b", "val", 2), (2, "7", "train", 3)]


def test_it_uploads_a_json_array(alice_api):
    content = json.dumps([{"q": i} for i in range(4)], indent=2)
    response = upload(alice_api, "arr", content, filename="tasks.json", val_ratio=0)
    assert response.status_code == 201, response.json()
    assert list(Task.objects.values_list("external_id", "split")) == [(str(i), "train") for i in range(4)]


def test_a_seeded_ratio_split_is_reproducible(alice_api):
    content = jsonl(*[{"q": i} for i in range(200)])
    first = upload(alice_api, "a", content, val_ratio=0.25, seed=3).json()
    second = upload(alice_api, "b", content, val_ratio=0.25, seed=3).json()
    third = upload(alice_api, "c", content, val_ratio=0.25, seed=4).json()
    splits = lambda d: list(Task.objects.filter(dataset_id=d["id"]).values_list("split", flat=True))  # noqa: E731
    assert splits(first) == splits(second) != splits(third)
    assert 30 <= first["val_count"] <= 70 and first["train_count"] + first["val_count"] == 200


def test_a_seed_the_column_cannot_hold_is_a_field_error_not_a_500(alice_api, alice):
    # The API fuzzer found it: seed=-8314293569 reached the database and failed with "integer out of range".
    content = jsonl({"q": 1}, {"q": 2})
    for seed in (-8314293569, 2 ** 31):
        response = upload(alice_api, f"s{seed}", content, val_ratio=0.5, seed=seed)
        assert response.status_code == 400, response.content
        assert "seed" in response.json()["error"]["fields"]
    assert upload(alice_api, "edge", content, val_ratio=0.5, seed=2 ** 31 - 1).status_code == 201
    with pytest.raises(ServiceError, match="seed: -2147483649 is out of range"):
        catalog_services.create_dataset(alice, name="direct", content=content.encode() if isinstance(content, str)
                                        else content, val_ratio=0.5, seed=-(2 ** 31) - 1)
    assert list(Dataset.objects.values_list("name", flat=True)) == ["edge"]


def test_a_split_field_is_required_on_every_line(alice_api):
    response = upload(alice_api, "s", jsonl({"q": 1, "part": "train"}, {"q": 2}, {"q": 3, "part": "test"}),
                      split_field="part")
    assert response.status_code == 400
    assert response.json()["error"]["lines"] == [
        {"line": 2, "error": "missing split field 'part'"},
        {"line": 3, "error": "field 'part' must be one of ['train', 'val'], got \"test\""},
    ]
    assert Dataset.objects.count() == 0 and Task.objects.count() == 0


def test_every_bad_line_is_reported_and_nothing_is_saved(alice_api):
    content = jsonl({"id": "ok", "question": "fine"}, '{"id": "broken", ', {"question": "no id is fine"},
                    [1, 2], {"id": ["x"], "question": "?"}, {"id": "ok", "question": "dup"},
                    {"id": "z"})
    response = upload(alice_api, "bad", content, required_fields="question")
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_dataset" and "5 bad line(s); nothing was saved" in error["message"]
    assert [(e["line"], e["error"].split(":")[0].split(" (")[0]) for e in error["lines"]] == [
        (2, "invalid JSON"),
        (4, "expected a JSON object, got an array"),
        (5, "field 'id' must be a string or an integer, got an array"),
        (6, "duplicate id 'ok'"),
        (7, "missing required field 'question'"),
    ]
    assert Dataset.objects.count() == 0 and Task.objects.count() == 0


def test_an_empty_file_is_refused(alice_api):
    for content in ("", "\n  \n"):
        response = upload(alice_api, "empty", content)
        assert response.status_code == 400
        assert response.json()["error"]["lines"][0]["error"].startswith("the file is empty")
    assert Dataset.objects.count() == 0


def test_a_huge_line_is_refused_with_its_number(alice_api, settings):
    settings.LIGHTNING_DATASET_MAX_LINE_BYTES = 1000
    response = upload(alice_api, "huge", jsonl({"q": 1}, {"q": "x" * 5000}))
    assert response.status_code == 400
    [line] = response.json()["error"]["lines"]
    assert line["line"] == 2 and "over the limit of 1000 bytes" in line["error"]
    assert Task.objects.count() == 0


def test_a_file_over_the_size_limit_is_refused(alice_api, settings):
    settings.LIGHTNING_DATASET_MAX_BYTES = 2048
    response = upload(alice_api, "big", jsonl(*[{"q": "y" * 100} for _ in range(50)]))
    assert response.status_code == 400 and "over the limit of 2048 bytes" in response.json()["error"]["message"]


def test_bad_json_array_reports_the_line(alice_api):
    response = upload(alice_api, "arr", '[\n {"q": 1},\n {"q": 2,\n]', filename="t.json")
    assert response.status_code == 400
    assert response.json()["error"]["lines"][0]["line"] == 4


def test_non_utf8_is_refused(alice_api):
    response = upload(alice_api, "latin", b'{"q": "ok"}\n{"q": "caf\xe9"}\n')
    assert response.status_code == 400
    assert response.json()["error"]["lines"] == [{"line": 2, "error": "not valid UTF-8 (invalid continuation byte at byte 22)"}]


def test_missing_file_and_name_are_field_errors(alice_api):
    response = alice_api.post(URL, {}, format="multipart")
    assert response.status_code == 400
    assert set(response.json()["error"]["fields"]) == {"name", "file"}


def test_a_duplicate_name_is_refused(alice_api, alice, make_dataset):
    make_dataset(alice, name="dup")
    response = upload(alice_api, "dup", jsonl({"q": 1}))
    assert response.status_code == 400 and "already have a dataset named 'dup'" in response.json()["error"]["message"]
    assert Dataset.objects.count() == 1


def test_users_see_only_their_datasets_and_tasks(alice_api, bob_api, staff_api, alice, bob, make_dataset):
    mine, theirs = make_dataset(alice, name="mine"), make_dataset(bob, name="theirs")
    assert [d["name"] for d in alice_api.get(URL).json()["results"]] == ["mine"]
    assert alice_api.get(f"{URL}{theirs.pk}/").status_code == 404
    assert {d["name"] for d in staff_api.get(URL).json()["results"]} == {"mine", "theirs"}
    tasks = alice_api.get("/api/v1/tasks/").json()
    assert tasks["count"] == 5 and {t["dataset"] for t in tasks["results"]} == {mine.pk}
    assert bob_api.delete(f"{URL}{mine.pk}/").status_code == 404
    assert Dataset.objects.filter(pk=mine.pk).exists()


def test_tasks_are_paginated_and_filter_by_split(alice_api, alice, make_dataset):
    dataset = make_dataset(alice, tasks=[{"id": i, "split": "val" if i % 4 == 0 else "train"} for i in range(120)])
    page = alice_api.get("/api/v1/tasks/", {"dataset": dataset.pk, "split": "val"}).json()
    assert page["count"] == 30 and all(t["split"] == "val" for t in page["results"])
    first = alice_api.get("/api/v1/tasks/", {"dataset": dataset.pk}).json()
    assert first["count"] == 120 and len(first["results"]) == 50 and first["next"]
    assert [t["index"] for t in first["results"]][:3] == [0, 1, 2]
    assert alice_api.get("/api/v1/tasks/", {"split": "nope"}).status_code == 400


def test_a_dataset_can_be_renamed_but_not_its_contents(alice_api, alice, make_dataset):
    dataset = make_dataset(alice)
    response = alice_api.patch(f"{URL}{dataset.pk}/", {"name": "renamed", "train_count": 99}, format="json")
    assert response.status_code == 200 and response.json()["name"] == "renamed"
    dataset.refresh_from_db()
    assert dataset.name == "renamed" and dataset.train_count == 4


def test_a_task_opens_for_its_owner_and_staff_and_is_hidden_from_others(alice_api, bob_api, staff_api, alice,
                                                                        make_dataset):
    task = make_dataset(alice, tasks=[{"id": "only", "split": "train", "q": 1}]).tasks.get()
    response = alice_api.get(f"/api/v1/tasks/{task.pk}/")
    # It answered 403 to its owner: the permission looked for an owner on the task, which has one via its dataset.
    assert response.status_code == 200 and response.json()["external_id"] == "only"
    assert staff_api.get(f"/api/v1/tasks/{task.pk}/").status_code == 200
    assert bob_api.get(f"/api/v1/tasks/{task.pk}/").status_code == 404


def test_owner_id_of_follows_the_same_relations_as_owned(alice, make_run, make_dataset):
    from catalog import selectors
    from runs import rollout_services

    run = make_run(alice)
    rollout, _ = rollout_services.create_rollout(run, task=run.dataset.tasks.first(), split="train", step=0,
                                                 group=0, attempt=0)
    for obj in (run, run.dataset, run.dataset.tasks.first(), rollout):
        assert selectors.owner_id_of(obj) == alice.pk
