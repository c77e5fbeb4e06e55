"""Real Chromium against a real daphne: log in, Swagger UI renders offline, a run page updates live."""
import os
import shutil

import pytest
from channels.testing import ChannelsLiveServerTestCase
from django.contrib.auth import get_user_model

from runs import services

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]
pytestmark = [pytest.mark.browser, pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                                      reason="Debian's chromium is not installed (.ci/run installs it)")]


@pytest.mark.usefixtures("models_dir")
class TestInChromium(ChannelsLiveServerTestCase):
    serve_static = True

    @classmethod
    def setUpClass(cls):
        os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"  # Playwright's sync API runs its own loop in this thread
        super().setUpClass()
        from playwright.sync_api import sync_playwright

        cls.playwright = sync_playwright().start()
        cls.browser = cls.playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)

    @classmethod
    def tearDownClass(cls):
        cls.browser.close()
        cls.playwright.stop()
        super().tearDownClass()

    def setUp(self):
        self.user = get_user_model().objects.create_user("alice", "a@example.com", "alice-password-123")
        self.page = self.browser.new_page()
        self.outside = []
        self.page.on("request", lambda r: None if r.url.startswith((self.live_server_url, "data:", "blob:"))
                     else self.outside.append(r.url))

    def tearDown(self):
        self.page.close()

    def login(self):
        self.page.goto(self.live_server_url + "/")
        assert "/accounts/login/" in self.page.url
        self.page.fill("input[name=username]", "alice")
        self.page.fill("input[name=password]", "alice-password-123")
        self.page.click("button[type=submit]")
        self.page.wait_for_selector("h1:has-text('Runs')")

    def test_swagger_ui_renders_offline(self):
        self.login()
        self.page.goto(self.live_server_url + "/api/docs/")
        self.page.wait_for_selector(".opblock", timeout=20000)
        assert self.page.locator(".opblock").count() > 20
        assert self.page.locator("text=/api/v1/runs/{id}/cancel/").count() >= 1
        assert self.outside == []  # nothing fetched from outside this server

    def test_a_run_page_shows_events_live(self):
        from tests.conftest import REWARD_SOURCE

        harness = services.create_harness(self.user, name="h", command=["python", "a.py"])
        dataset = services.create_dataset(self.user, name="d", content=b'{"q": 1}\n{"q": 2}\n', filename="t.jsonl")
        reward = services.create_reward_script(self.user, name="r", source=REWARD_SOURCE)
        run = services.create_run(self.user, name="<b>live</b>", model="tiny", config={}, harness=harness,
                                  dataset=dataset, reward_script=reward)
        self.login()
        self.page.goto(f"{self.live_server_url}/runs/{run.pk}/")
        self.page.wait_for_selector("#events li")  # the replayed 'queued' event
        assert self.page.locator("h1").inner_text().startswith("<b>live</b>")  # shown as text, not markup
        services.transition_run(run.pk, "starting")
        services.fail_run(run.pk, "engine exited with code 1")
        self.page.wait_for_function("document.getElementById('run-status').textContent === 'failed'", timeout=15000)
        assert self.page.locator("#run-error").inner_text() == "engine exited with code 1"
        assert self.page.locator("#events li").count() == 3
        assert self.outside == []
