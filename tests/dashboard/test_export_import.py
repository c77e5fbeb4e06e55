"""The way back: a rollouts export uploaded as a dataset (API and page) becomes a dataset of recorded trajectories,
one task per rollout holding the calls and samples as exported."""
import json

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from catalog import services as catalog_services
from catalog.models import Dataset, Task
from common import errors as common_errors
from runs.models import ModelCall, Sample
from tests.dashboard.export_seed import seed_export_run

pytestmark = pytest.mark.django_db


@pytest.fixture
def exported(client, alice, make_run):
    run, rows = seed_export_run(alice, make_run)
    client.force_login(alice)
    content = b"".join(client.get(f"/runs/{run.pk}/export.jsonl").streaming_content)
    return run, rows, content


def assert_recorded(dataset, rows):
    tasks = {t.external_id: t for t in Task.objects.filter(dataset=dataset)}
    assert set(tasks) == {f"rollout-{r.pk}" for r in rows.values()}
    assert {name: tasks[f"rollout-{r.pk}"].split for name, r in rows.items()} == {
        "trained": "train", "dropped": "train", "failed": "val"}
    assert (dataset.train_count, dataset.val_count) == (2, 1)
    trained = tasks[f"rollout-{rows['trained'].pk}"].data
    assert trained["schema"] == "lightning-web/rollout-export" and trained["rollout"]["reward"] == 1.0
    calls = list(ModelCall.objects.filter(rollout=rows["trained"]).order_by("seq"))
    assert [(c["seq"], c["request"], c["response"], c["prompt_ids"], c["completion_ids"], c["logprobs"])
            for c in trained["calls"]] == [(c.seq, c.request, c.response, c.prompt_ids, c.completion_ids, c.logprobs)
                                           for c in calls]
    sample = Sample.objects.get(rollout=rows["trained"])
    assert [(s["token_ids"], s["loss_mask"], s["logprobs"], s["trainer_logprobs"], s["advantage"], s["spans"])
            for s in trained["samples"]] == [(sample.token_ids, sample.loss_mask, sample.logprobs,
                                              sample.trainer_logprobs, sample.advantage, sample.spans)]


def test_an_export_uploaded_through_the_api_is_a_dataset_of_trajectories(alice_api, exported):
    run, rows, content = exported
    response = alice_api.post("/api/v1/datasets/", {"name": "recorded", "file": SimpleUploadedFile(
        f"run-{run.pk}-rollouts.jsonl", content), "val_ratio": 0.5, "split_field": ""}, format="multipart")
    assert response.status_code == 201, response.content
    assert response.json()["train_count"] == 2 and response.json()["val_count"] == 1  # the rollouts' splits win
    assert_recorded(Dataset.objects.get(pk=response.json()["id"]), rows)


def test_an_export_uploaded_on_the_page_is_a_dataset_of_trajectories(client, exported):
    run, rows, content = exported
    response = client.post("/datasets/upload/", {
        "name": "recorded", "description": "", "split_by": "ratio", "val_ratio": "0", "seed": "0", "split_field": "",
        "hidden_fields": "", "required_fields": "", "file": SimpleUploadedFile("export.jsonl", content)})
    dataset = Dataset.objects.get(name="recorded")
    assert response.status_code == 302 and response["Location"] == f"/datasets/{dataset.pk}/"
    assert_recorded(dataset, rows)


def test_a_file_mixing_export_records_and_tasks_is_refused_line_by_line(alice, exported):
    _, rows, content = exported
    bad = content + b'{"id": "t9", "question": "2+2"}\n' + content.splitlines()[0] + b"\n"
    with pytest.raises(common_errors.DatasetRejected) as refused:
        catalog_services.create_dataset(alice, name="mixed", content=bad, filename="mixed.jsonl")
    assert refused.value.errors == [
        {"line": 4, "error": 'not a rollouts export record (expected "schema": "lightning-web/rollout-export" as on '
                             'the first line)'},
        {"line": 5, "error": f"rollout {rows['trained'].pk} appears twice (first on line 1)"}]
    assert not Dataset.objects.filter(name="mixed").exists()


def test_an_unknown_export_version_is_refused(alice, exported):
    _, _, content = exported
    first = json.loads(content.splitlines()[0])
    first["version"] = 99
    with pytest.raises(common_errors.DatasetRejected) as refused:
        catalog_services.create_dataset(alice, name="future", content=json.dumps(first).encode(), filename="f.jsonl")
    assert refused.value.errors == [{"line": 1, "error": "export version 99 is not one of [1]"}]


def test_a_task_file_that_mentions_the_schema_is_still_a_task_file(alice):
    content = b'{"id": "a", "note": "lightning-web/rollout-export", "answer": 1}\n'
    dataset = catalog_services.create_dataset(alice, name="plain", content=content, filename="t.jsonl")
    assert list(Task.objects.filter(dataset=dataset).values_list("external_id", "data")) == [
        ("a", {"id": "a", "note": "lightning-web/rollout-export", "answer": 1})]
