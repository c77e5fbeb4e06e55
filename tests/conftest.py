"""Shared fixtures: the usual actors (alice owns things, bob must not see them, staff sees all) and isolation."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
from django.conf import settings
from django.contrib.auth.hashers import PBKDF2PasswordHasher, get_hashers, get_hashers_by_algorithm
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from lightning_web.celery import app as celery_app
from tests.lanes import lane, lane_redis_db

pytest_plugins = [
    "tests.ci_required",  # in CI a skip for a missing sandbox, engine venv or Chromium fails
    "tests.tiers",  # the fast tier (`./lw test`) and the full one (`./lw test --all`)
    "tests.conformance.summary",  # the conformance table and its skip rule, from every lane's reports
]

# Tests talk to the same real Redis as the app (embedded or REDIS_URL) but never to its queues or groups. A second
# test session on the same machine (CI while a developer tests) takes its own database with LIGHTNING_TEST_REDIS_DB
# (and its own DATABASE_URL): the tests flush theirs. Each lane of a parallel run is such a session (tests/lanes.py).
TEST_REDIS_DB = lane_redis_db(int(os.environ.get("LIGHTNING_TEST_REDIS_DB", "15")), lane(), settings.REDIS_URL)
settings.CHANNEL_LAYERS["default"]["CONFIG"]["prefix"] = (
    "lightning-test" if TEST_REDIS_DB == 15 else f"lightning-test-{TEST_REDIS_DB}")
celery_app.conf.broker_url = settings.REDIS_URL.rsplit("/", 1)[0] + f"/{TEST_REDIS_DB}"


class FastPasswordHasher(PBKDF2PasswordHasher):
    """PBKDF2 at 1,000 iterations: the actors below are made afresh for each test (about 800 users in the fast tier,
    0.3 s each at Django's default). The hashes say pbkdf2_sha256 and carry their iterations, so a daphne or worker
    process on the default hashers verifies these passwords as it does any user's."""

    iterations = 1000


settings.PASSWORD_HASHERS = ["tests.conftest.FastPasswordHasher", *settings.PASSWORD_HASHERS]
get_hashers.cache_clear()
get_hashers_by_algorithm.cache_clear()

ENGINE_CACHE_DIR = Path(tempfile.gettempdir()) / "lightning-test-engine-cache"
REWARD_SOURCE = '''
def reward(task, outcome):
    return {"reward": float(outcome.get("answer") == task.get("answer")), "checked": True}
'''


@pytest.fixture(autouse=True)
def models_dir(tmp_path_factory, settings):
    """A models registry holding one folder named `tiny` (config and marker only: nothing loads it here)."""
    root = tmp_path_factory.getbasetemp() / "registry"
    if not (root / "tiny" / "config.json").exists():
        (root / "tiny").mkdir(parents=True, exist_ok=True)
        (root / "tiny" / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
        (root / "tiny" / "lightning_model.json").write_text(json.dumps({"name": "tiny", "origin": "tiny", "params": 1}))
    settings.LIGHTNING_MODELS_DIR = root
    return root


@pytest.fixture(autouse=True)
def engine_cache_dir(settings):
    """Engine starts share a compile cache across test sessions, outside the app's data dir (tiny models only)."""
    settings.LIGHTNING_ENGINE_CACHE_DIR = ENGINE_CACHE_DIR
    return ENGINE_CACHE_DIR


@pytest.fixture
def test_redis():
    """A client on the tests' Redis database, emptied before and after."""
    import redis

    client = redis.Redis.from_url(celery_app.conf.broker_url)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


def _user(django_user_model, name, **extra):
    return django_user_model.objects.create_user(name, f"{name}@example.com", f"{name}-password-123", **extra)


@pytest.fixture
def alice(django_user_model):
    return _user(django_user_model, "alice")


@pytest.fixture
def bob(django_user_model):
    return _user(django_user_model, "bob")


@pytest.fixture
def staff(django_user_model):
    return _user(django_user_model, "sam", is_staff=True)


def _client(user):
    client = APIClient()
    token, _ = Token.objects.get_or_create(user=user)
    client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    return client


@pytest.fixture
def alice_api(alice):
    return _client(alice)


@pytest.fixture
def bob_api(bob):
    return _client(bob)


@pytest.fixture
def staff_api(staff):
    return _client(staff)


@pytest.fixture
def make_harness():
    from catalog import services as catalog_services

    def make(owner, name="agent", **fields):
        fields.setdefault("command", ["python", "agent.py", "--task", "{task_file}", "--out", "{output_file}"])
        return catalog_services.create_harness(owner, name=name, **fields)

    return make


@pytest.fixture
def make_dataset():
    from catalog import services as catalog_services

    def make(owner, name="tasks", tasks=None, **options):
        tasks = tasks if tasks is not None else [
            {"id": f"t{i}", "question": f"{i}+1", "answer": i + 1, "split": "val" if i == 0 else "train"}
            for i in range(5)
        ]
        content = "\n".join(json.dumps(t) for t in tasks).encode()
        return catalog_services.create_dataset(owner, name=name, content=content, filename="tasks.jsonl", **options)

    return make


@pytest.fixture
def make_reward():
    from catalog import services as catalog_services

    def make(owner, name="exact", source=REWARD_SOURCE, **fields):
        return catalog_services.create_reward_script(owner, name=name, source=source, **fields)

    return make


@pytest.fixture
def make_run(make_harness, make_dataset, make_reward):
    """A queued run of `owner`. Under the `db` fixture on_commit never fires, so nothing is enqueued."""
    from runs import services

    def make(owner, name="run", config=None):
        return services.create_run(owner, name=name, model="tiny", config=config or {},
                                   harness=make_harness(owner, name=f"{name}-h"),
                                   dataset=make_dataset(owner, name=f"{name}-d"),
                                   reward_script=make_reward(owner, name=f"{name}-r"))

    return make
