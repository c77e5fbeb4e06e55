"""No page shows template syntax: every page of the dashboard's tour, rendered over a run with rollouts, steps,
samples, alarms and a re-scoring, has no `{#`, `#}`, `{%` or `{{` in the text a reader sees (issue 40.10: a
multi-line `{# #}` comment, which Django leaves as text, showed under every run page's buttons)."""
from __future__ import annotations

from html.parser import HTMLParser

import pytest
from django.test import Client
from django.urls import reverse

from health import rescoring
from health import services as health_services
from runs.models import HarnessCheck, Rollout, Run
from tests.dashboard.test_page_queries import side
from tests.health.steps import Attempt, store_step

pytestmark = pytest.mark.django_db

SYNTAX = ("{#", "#}", "{%", "{{")
HIDDEN = {"script", "style"}
"""Elements whose content is not text on the page (attribute values are not text either)."""


class VisibleText(HTMLParser):
    """The text a browser shows of a page: its text nodes outside <script> and <style>, without attributes."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._hidden = 0

    def handle_starttag(self, tag, attrs) -> None:
        self._hidden += tag in HIDDEN

    def handle_endtag(self, tag) -> None:
        self._hidden -= tag in HIDDEN and self._hidden > 0

    def handle_data(self, data) -> None:
        if not self._hidden:
            self.parts.append(data)


def visible_text(html: str) -> str:
    parser = VisibleText()
    parser.feed(html)
    parser.close()
    return " ".join(parser.parts)


def shown_syntax(text: str) -> list[str]:
    """Each piece of template syntax in `text`, with the words around it."""
    return [text[max(0, i - 40):i + 60].replace("\n", " ") for token in SYNTAX
            for i in range(len(text)) if text.startswith(token, i)]


@pytest.fixture
def tour(django_user_model, make_dataset):
    """(logged-in client, {page: URL}) for every page of the tour, over a seeded run and its peer."""
    s = side(django_user_model, make_dataset, "tourist", rollouts=6, calls=2)
    run = Run.objects.get(pk=s.run)
    user, harness, script = run.owner, run.harness, run.reward_script
    store_step(run, 3, [[Attempt(reward=1.0) for _ in range(4)] for _ in range(4)])  # a collapse: alarms
    health_services.check_step(run.pk, 3)
    assert run.alarms.exists()
    rescore = rescoring.start_rescore(user, run, script)
    check = HarnessCheck.objects.create(owner=user, harness=harness, harness_version=harness.version,
                                        task={"id": "t1", "question": "1+1"}, task_source={"typed": True},
                                        reward_script=script, model="tiny")
    val_rollout = Rollout.objects.filter(run=run, split="val").first()
    pages = {
        "runs list": reverse("runs-list"),
        "new run": reverse("run-new"),
        "run": reverse("run-detail", args=[run.pk]),
        "run health": reverse("run-health", args=[run.pk]),
        "re-scoring": reverse("run-rescore", args=[run.pk, rescore.pk]),
        "rollout": reverse("rollout-detail", args=[s.rollout]),
        "val rollout": reverse("rollout-detail", args=[val_rollout.pk]),
        "step": reverse("run-step", args=[run.pk, 1]),
        "token view": reverse("sample-tokens", args=[s.sample]),
        "compare": reverse("run-compare") + f"?ids={run.pk},{s.peer}",
        "val task compare": reverse("val-task-compare", args=[run.pk, s.val_task]) + "?a=1&b=2",
        "harnesses": reverse("harness-list"),
        "new harness": reverse("harness-new"),
        "harness": reverse("harness-detail", args=[harness.pk]),
        "harness check": reverse("harness-check", args=[harness.pk, check.pk]),
        "reward scripts": reverse("reward-list"),
        "new reward script": reverse("reward-new"),
        "reward script": reverse("reward-detail", args=[script.pk]),
        "datasets": reverse("dataset-list"),
        "dataset upload": reverse("dataset-new"),
        "dataset": reverse("dataset-detail", args=[s.dataset]),
        "models": reverse("model-list"),
        "workers": reverse("worker-list"),
    }
    return s.client, pages


def test_no_page_of_the_tour_shows_template_syntax(tour, test_redis):
    client, pages = tour
    shown = {}
    for name, url in pages.items():
        response = client.get(url)
        assert response.status_code == 200, (name, url, response.status_code)
        text = visible_text(response.content.decode())
        assert len(text.split()) > 5, (name, url, text)  # a page with words, not an empty shell
        if found := shown_syntax(text):
            shown[name] = found
    login = Client().get(reverse("login"))
    assert login.status_code == 200
    shown.update({"login": found} if (found := shown_syntax(visible_text(login.content.decode()))) else {})
    assert shown == {}


def test_the_visible_text_leaves_out_scripts_styles_and_attributes():
    html = ('<p title="{{ a }}">shown {</p><script>if (x) {{ }} "{%"</script><style>a{#b}</style>'
            '<pre>{# raw #}</pre>')
    assert visible_text(html) == "shown { {# raw #}"
    assert shown_syntax(visible_text(html)) == ["shown { {# raw #}", "shown { {# raw #}"]
