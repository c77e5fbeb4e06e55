"""A real daphne process over the test database, and Debian's Chromium driven by Playwright."""
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection

from common.procs import free_port
from lightning_web.celery import app as celery_app

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]


def _database_url() -> str:
    db = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{db['NAME']}"
    auth = db["USER"] + (f":{db['PASSWORD']}" if db["PASSWORD"] else "")
    return f"postgres://{auth}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


@pytest.fixture
def live_url(transactional_db, models_dir, tmp_path):
    """The app served by daphne in its own process, reading and writing the test database."""
    port = free_port()
    env = dict(os.environ, DATABASE_URL=_database_url(), REDIS_URL=settings.REDIS_URL,
               CELERY_BROKER_URL=celery_app.conf.broker_url,  # runs it enqueues go to the tests' queues
               CHANNELS_PREFIX=settings.CHANNEL_LAYERS["default"]["CONFIG"]["prefix"],
               LIGHTNING_DATA_DIR=str(settings.DATA_DIR), LIGHTNING_MODELS_DIR=str(models_dir))
    log = open(tmp_path / "daphne.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port),
                             "lightning_web.asgi:application"], cwd=ROOT, env=env, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url + "/accounts/login/", timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"daphne did not start:\n{(tmp_path / 'daphne.log').read_text()}")
            time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(timeout=20)
    log.close()


@pytest.fixture
def control_worker(live_url, tmp_path, test_redis):
    """The control worker `./lw up` starts (a real Celery worker on the `default` queue): it scores the reward
    test panel's tests, which the web server only queues."""
    from tests.workers import Workers

    (tmp_path / "control-worker").mkdir()
    pool = Workers(tmp_path / "control-worker")
    pool.start("control", "default")
    yield pool
    pool.stop()


@pytest.fixture(scope="module")
def browser():
    """Module-scoped: Playwright's sync API holds an event loop in this thread until it stops."""
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (.ci/run installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield chromium
        chromium.close()


def _wait_for_function(page):
    """page.wait_for_function that polls through page.evaluate. Playwright's own re-runs the expression with
    `eval` inside the page, which the app's Content-Security-Policy (no 'unsafe-eval') refuses; an evaluate
    comes through DevTools, which the policy lets through, so the pages are tested under the real policy."""
    from playwright.sync_api import Error, TimeoutError

    def wait(expression, *, arg=None, timeout=None):
        deadline = time.monotonic() + (30_000 if timeout is None else timeout) / 1000
        while True:
            try:
                value = page.evaluate(expression, arg)
            except Error as exc:  # a navigation between two polls: poll the new document
                if "Execution context was destroyed" not in exc.message:
                    raise
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"waiting for {expression!r}: still {value!r} after {timeout or 30_000} ms")
            page.wait_for_timeout(50)

    return wait


@pytest.fixture
def page(browser, live_url):
    """A fresh page; `page.outside` lists every request that left the live server."""
    page = browser.new_page()
    page.wait_for_function = _wait_for_function(page)
    page.outside = []
    page.on("request", lambda r: None if r.url.startswith((live_url, "data:", "blob:")) else page.outside.append(r.url))
    yield page
    page.close()


@pytest.fixture
def console(page):
    """Every console error and uncaught page error of `page`, as 'url: text' lines (a test asserts it stays empty)."""
    errors = []
    page.on("console", lambda msg: errors.append(f"{msg.location.get('url')}: {msg.text}")
            if msg.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(f"page error: {exc}"))
    return errors
