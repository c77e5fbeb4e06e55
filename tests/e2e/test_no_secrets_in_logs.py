"""Passwords, API tokens, rollout keys, the Redis password and the SECRET_KEY never reach a log.

One full real run (vLLM on CPU serving the tiny model, real Celery workers at DEBUG, a real web server) on an
embedded, password-protected Redis; web traffic with an API token and a session login as the admin; then every log
file (web, workers, and everything the run wrote under its folder: engine, proxy, harness output) is searched for
each secret, as are the run's log events and the rollouts' output tails in the database (the run page's logs).
Rollout keys are stored only as sha256 in the database: every key-sized word in the logs is hashed and
looked up. Run under the heavy lock on a shared machine.
"""
import hashlib
import json
import re
import secrets
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from catalog import services
from common.procs import free_port, kill_groups
from lightning_web import embedded_redis
from runs.models import Rollout, Run, RunEvent
from tests.workers import REAL_RUN_MARKS, ROOT, Workers, wait_db

pytestmark = REAL_RUN_MARKS

# The key also travels on the command line ({api_key}), where a logged argv would leak it.
HARNESS = '''
import json, os, sys, urllib.request
task = json.load(open(sys.argv[1]))
key = sys.argv[sys.argv.index("--api-key") + 1]
body = {"model": "policy", "messages": [{"role": "user", "content": task["question"]}], "max_tokens": 8}
request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
reply = json.loads(urllib.request.urlopen(request, timeout=120).read())["choices"][0]["message"]["content"]
print("got a reply of", len(reply), "characters")
json.dump({"reply": reply}, open(sys.argv[2], "w"))
'''
REWARD = "def reward(task, outcome):\n    return float(len(outcome['reply']) % 2)\n"
CONFIG = {"steps": 1, "tasks_per_step": 2, "group_size": 2, "checkpoint_every": 1, "max_model_len": 512,
          "kv_cache_gb": 0.5, "eval_tasks": 1, "eval_samples": 1}
KEY_WORD = re.compile(rb"[A-Za-z0-9_\-]{43,}")  # secrets.token_urlsafe(32), the rollout keys, is 43 characters
NOT_LOGS = {"password", "redis.conf"}  # the embedded Redis's own secret files (0600), not logs


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    from trainer.models import build_tiny_model

    root = tmp_path_factory.mktemp("secrets-registry")
    build_tiny_model(root / "tiny-real", seed=0, name="tiny-real")
    return root


@pytest.fixture
def redis_url(tmp_path):
    """A Redis of this test's own as the app starts it without REDIS_URL: password-protected."""
    url = embedded_redis.ensure_running(tmp_path / "redis-home")
    yield url
    embedded_redis.stop(tmp_path / "redis-home")


@pytest.fixture
def stack(tmp_path, settings, registry, redis_url):
    """Workers (DEBUG logs) and a daphne web server on the embedded Redis, with a SECRET_KEY we know."""
    settings.LIGHTNING_MODELS_DIR = registry
    pool = Workers(tmp_path)
    settings.LIGHTNING_RUNS_DIR = pool.runs_dir
    secret_key = secrets.token_urlsafe(50)
    pool.env.update(REDIS_URL=redis_url, CELERY_BROKER_URL=redis_url, SECRET_KEY=secret_key, LOG_LEVEL="DEBUG",
                    CHANNELS_PREFIX="secrets-test",
                    # Not a durability test: a busy shared machine must not get the run swept as lost.
                    LIGHTNING_HEARTBEAT_EVERY_S="5", LIGHTNING_RUN_LOST_AFTER_S="120")
    port = free_port()
    web = subprocess.Popen([sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "-v", "2",
                            "lightning_web.asgi:application"], cwd=ROOT, env=pool.env,
                           stdout=open(pool.logs / "web.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_db(lambda: _answers(f"http://127.0.0.1:{port}/accounts/login/"), "the web server", pool, timeout=60)
        yield pool, f"http://127.0.0.1:{port}", secret_key
    finally:
        kill_groups([web.pid], grace_s=10)
        web.wait()
        pool.stop()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _session_login(base: str, username: str, password: str) -> httpx.Client:
    client = httpx.Client(base_url=base, timeout=30)
    client.get("/accounts/login/")
    response = client.post("/accounts/login/", data={"username": username, "password": password,
                                                     "csrfmiddlewaretoken": client.cookies["csrftoken"]})
    assert response.status_code == 302 and "sessionid" in client.cookies, response.text[:500]
    return client


def _websocket_opens(base: str, path: str) -> bool:
    """A raw websocket handshake: True when the server accepts it (101)."""
    import base64
    import socket

    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall((f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                      f"Sec-WebSocket-Key: {base64.b64encode(secrets.token_bytes(16)).decode()}\r\n"
                      f"Sec-WebSocket-Version: 13\r\nOrigin: {base}\r\n\r\n").encode())
        return conn.recv(4096).startswith(b"HTTP/1.1 101")


def _log_files(tmp_path: Path) -> list[Path]:
    return [p for p in tmp_path.rglob("*") if p.is_file() and p.name not in NOT_LOGS
            and "secrets-registry" not in str(p)]


def test_a_full_run_logs_no_secret(tmp_path, stack, django_user_model):
    pool, base, secret_key = stack
    admin_password, alice_password = secrets.token_urlsafe(12), secrets.token_urlsafe(16)
    django_user_model.objects.create_superuser("admin", "admin@localhost", admin_password)
    alice = django_user_model.objects.create_user("alice", "alice@example.com", alice_password)
    (tmp_path / "harness.py").write_text(HARNESS)
    harness = services.create_harness(alice, name="keyed", timeout_s=120, command=[
        "python3", str(tmp_path / "harness.py"), "{task_file}", "{output_file}", "--api-key", "{api_key}"])
    tasks = "\n".join(f'{{"id": "t{i}", "question": "say {i}", "split": "{"val" if i < 1 else "train"}"}}'
                      for i in range(4))
    dataset = services.create_dataset(alice, name="words", content=tasks.encode(), filename="t.jsonl")
    reward = services.create_reward_script(alice, name="odd", source=REWARD)
    pool.start("runs", "runs", loglevel="DEBUG")
    pool.start("control", "default", beat=True, loglevel="DEBUG")

    # The API: a token from the username and password (one wrong try first), then a run created with it.
    api = httpx.Client(base_url=base, timeout=60)
    assert api.post("/api/v1/auth/token/", json={"username": "alice", "password": "not-" + alice_password}
                    ).status_code == 400
    token = api.post("/api/v1/auth/token/", json={"username": "alice", "password": alice_password}).json()["token"]
    api.headers["Authorization"] = f"Token {token}"
    created = api.post("/api/v1/runs/", json={"name": "secrets", "model": "tiny-real", "config": CONFIG,
                                              "harness": harness.pk, "dataset": dataset.pk, "reward_script": reward.pk})
    assert created.status_code == 201, created.text
    run_id = created.json()["id"]
    # The dashboard as the admin, logged in with the admin password.
    admin = _session_login(base, "admin", admin_password)
    assert admin.get(f"/runs/{run_id}/").status_code == 200 and admin.get("/api/v1/runs/").status_code == 200
    # The run's live events over a websocket, authenticated by the token in the query string (as API clients do).
    assert _websocket_opens(base, f"/ws/runs/{run_id}/?token={token}")

    wait_db(lambda: Run.objects.get(pk=run_id).status in ("succeeded", "failed"), "the end of the run", pool,
            timeout=900)
    run = Run.objects.get(pk=run_id)
    assert (run.status, run.error) == ("succeeded", ""), pool.tails()
    assert api.get(f"/api/v1/runs/{run_id}/").json()["status"] == "succeeded"
    assert admin.get(f"/api/v1/rollouts/?run={run_id}").status_code == 200
    api.close(), admin.close()
    pool.stop()  # flush and close every log before reading them

    key_hashes = set(Rollout.objects.filter(run_id=run_id).values_list("secret_hash", flat=True)) - {""}
    assert len(key_hashes) >= 5  # 2 tasks x 2 samples of step 1, and the evaluation's
    redis_password = redis_url_password(pool.env["REDIS_URL"])
    named = {"admin password": admin_password, "alice's password": alice_password, "alice's API token": token,
             "the Redis password": redis_password, "the SECRET_KEY": secret_key}
    from rest_framework.authtoken.models import Token

    named.update({f"{t.user.username}'s API token ({t.pk})": t.key for t in Token.objects.select_related("user")})

    files = _log_files(tmp_path)
    names = {p.name for p in files}
    assert {"web.log", "runs.log", "control.log", "engine.log"} <= names, sorted(names)
    text_of = {p: p.read_bytes() for p in files}
    # The logs the run page shows come from the database: its log events and the rollouts' output tails.
    shown = [json.dumps(e.payload) for e in RunEvent.objects.filter(run_id=run_id)] + [
        f"{r.stdout_tail}\n{r.stderr_tail}\n{r.error}" for r in Rollout.objects.filter(run_id=run_id)]
    assert any("starting the engine" in line for line in shown)
    text_of[tmp_path / "run page log (database)"] = "\n".join(shown).encode()
    worker_log = text_of[pool.logs / "runs.log"].decode(errors="replace")
    assert f"run {run_id}" in worker_log and "DEBUG" in worker_log  # the logs are the real, verbose ones
    assert "POST /api/v1/runs/" in text_of[pool.logs / "web.log"].decode(errors="replace")

    probe = secrets.token_urlsafe(32)  # the search finds a planted key and a planted password
    assert find_leaks({Path("p"): f"Bearer {probe}.".encode()}, {}, {hashlib.sha256(probe.encode()).hexdigest()})
    assert find_leaks({Path("p"): f"pw={admin_password}&".encode()}, named, set()) == ["admin password in p"]

    leaks = find_leaks({path.relative_to(tmp_path): data for path, data in text_of.items()}, named, key_hashes)
    assert leaks == [], "\n".join(leaks)


def find_leaks(text_of: dict[Path, bytes], named: dict[str, str], key_hashes: set[str]) -> list[str]:
    """'<what> in <file>' for each named secret found verbatim, and each word whose sha256 is a rollout key's."""
    leaks = [f"{what} in {path}" for path, data in text_of.items()
             for what, secret in named.items() if secret.encode() in data]
    for path, data in text_of.items():
        for word in KEY_WORD.findall(data):
            for start in range(len(word) - 42):
                if hashlib.sha256(word[start:start + 43]).hexdigest() in key_hashes:
                    leaks.append(f"a rollout's API key in {path}")
    return sorted(set(leaks))


def redis_url_password(url: str) -> str:
    password = url.split("://", 1)[1].split("@", 1)[0].split(":", 1)[1]
    assert len(password) >= 40
    return password
