"""Schemathesis against the API's own OpenAPI schema, in-process over WSGI, as a user who owns one of everything.

Every operation of /api/schema/ gets generated cases; each response must not be a 5xx and must match what the
schema documents (status code, content type, body). The CI budget is LIGHTNING_FUZZ_EXAMPLES per operation (default
below); bench/api_fuzz.py runs the full count through this same test and reads the per-operation counts it writes.

Nothing is enqueued on commit: under the `db` fixture the test runs inside one transaction, so the on_commit hooks
that queue Celery tasks (run create/resume, harness checks) never fire, and no engine or harness starts. A reward
script's `test` queues its scoring at once: a real control worker (as `./lw up` starts it) scores those cases.
"""
from __future__ import annotations

import json
import os
from collections import Counter

import hypothesis
import pytest
import schemathesis
from django.core.handlers.wsgi import WSGIHandler
from django.core.signals import request_finished, request_started
from django.db import close_old_connections, transaction
from drf_spectacular.generators import SchemaGenerator
from hypothesis import HealthCheck, strategies as st
from rest_framework.authtoken.models import Token
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)

from tests.workers import workers  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.django_db, pytest.mark.slow]

EXAMPLES_PER_OPERATION = int(os.environ.get("LIGHTNING_FUZZ_EXAMPLES", "25"))  # 42 operations: 1,050 cases
COUNTS_FILE = os.environ.get("LIGHTNING_FUZZ_COUNTS_FILE")


def no_constraint_conflict(ctx, response, case):
    """The handler answers a database constraint with 409 "conflict" because only a race should get past the
    serializers; one client sending one request at a time never races, so here it is a missing serializer check."""
    if response.status_code == 409 and b'"code":"conflict"' in response.content:
        raise AssertionError("a constraint failed that the serializers should have reported as a 400")


CHECKS = [not_a_server_error, response_schema_conformance, status_code_conformance, content_type_conformance,
          no_constraint_conflict]


@pytest.fixture
def owned(alice, make_run):
    """alice's token and the ids of a run and everything it uses, so generated paths can hit real rows."""
    run = make_run(alice)
    task = run.dataset.tasks.first()
    ids = {"harnesses": run.harness_id, "datasets": run.dataset_id, "reward-scripts": run.reward_script_id,
           "runs": run.pk, "tasks": task.pk}
    return Token.objects.get_or_create(user=alice)[0].key, ids


@pytest.fixture
def keep_connection():
    """The WSGI app closes the database connection after each request; Django's test Client unhooks that too, so
    every case runs in this test's transaction."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


def _schema():
    """The schema /api/schema/ serves, bound to the Django app so cases run in-process in this test's transaction."""
    schema = schemathesis.openapi.from_dict(SchemaGenerator().get_schema(request=None, public=True))
    schema.app = WSGIHandler()
    return schema


def _collection(path: str) -> str:
    return path.split("/api/v1/", 1)[1].split("/", 1)[0]


def _fuzz_operation(operation, token: str, ids: dict, failures: list[dict]) -> int:
    """Run the generated cases of one operation; half of the {id} paths name a real row of the user's."""
    calls = 0
    real_id = ids.get(_collection(operation.path))

    @hypothesis.settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None, derandomize=True,
                         suppress_health_check=list(HealthCheck), phases=[hypothesis.Phase.generate])
    @hypothesis.given(case=operation.as_strategy(), use_real_id=st.booleans())
    def run(case, use_real_id):
        nonlocal calls
        if use_real_id and real_id is not None and "id" in (case.path_parameters or {}):
            case.path_parameters["id"] = real_id
        calls += 1
        with transaction.atomic():  # a savepoint: one case that breaks the transaction must not fail the next
            response = case.call(headers={"Authorization": f"Token {token}"})
        try:
            case.validate_response(response, checks=CHECKS)
        except (FailureGroup, AssertionError) as exc:  # collect every operation's failures, report them together
            failures.append({"operation": f"{operation.method.upper()} {operation.path}",
                             "status": response.status_code, "message": str(exc)})

    run()
    return calls


@pytest.fixture
def control_worker(workers):  # noqa: F811 (tests.workers' fixture)
    workers.start("control", "default")
    return workers


def test_every_operation_survives_generated_cases(owned, keep_connection, control_worker):
    token, ids = owned
    failures: list[dict] = []
    counts: Counter[str] = Counter()
    for result in _schema().get_all_operations():
        operation = result.ok()
        counts[f"{operation.method.upper()} {operation.path}"] = _fuzz_operation(operation, token, ids, failures)
    if COUNTS_FILE:
        with open(COUNTS_FILE, "w") as out:
            json.dump({"counts": counts, "failures": failures}, out)
    assert len(counts) >= 40 and all(counts.values())
    assert failures == []


def test_renaming_a_dataset_to_a_taken_name_is_a_field_error(alice_api, alice, make_dataset):
    """Found by the fuzz: the rename reached the unique constraint and answered a 409 meant for races."""
    make_dataset(alice, name="arrow")
    other = make_dataset(alice, name="bow")
    response = alice_api.patch(f"/api/v1/datasets/{other.pk}/", {"name": "arrow"}, format="json")
    assert response.status_code == 400
    assert response.json()["error"]["fields"] == {"name": ["you already have a dataset named 'arrow'"]}
    other.refresh_from_db()
    assert other.name == "bow"
    assert alice_api.patch(f"/api/v1/datasets/{other.pk}/", {"name": "bow"}, format="json").status_code == 200
