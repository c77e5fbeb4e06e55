"""`manage.py load_demo`: the arithmetic demo (examples/arith) for a user, and its preset run (`--start-run`).

The preset (model, names and TrainerConfig) lives in examples/arith/preset.json only: `./lw demo`, the dashboard's
"Start the demo run" button and bench/demo_learning.py all read it from there.
"""
from __future__ import annotations

import json
import sys
import time
import urllib.request
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.urls import reverse

from catalog import services as catalog_services
from catalog.models import Dataset, Harness, RewardScript
from common import errors as common_errors
from common import procs
from runs import presets, services
from runs.models import Run

DEMO = settings.BASE_DIR / "examples" / "arith"
PRESET_FILE = DEMO / "preset.json"
REPO_TASKS = settings.BASE_DIR / "examples" / "repo_tasks"
REPO_DATASET, REPO_REWARD = "repo-tasks", "repo-checks"
"""The repository task suite's dataset and reward script, as the harness templates' presets name them."""


def demo_preset() -> dict[str, Any]:
    """The demo run's preset: name, model, the names of its harness, dataset and reward script, and its config."""
    return json.loads(PRESET_FILE.read_text())


def ensure_demo(user) -> tuple[Harness, Dataset, RewardScript]:
    """The user's demo harness, dataset and reward script, created where missing (existing ones are kept)."""
    preset = demo_preset()
    harness = Harness.objects.filter(owner=user, name=preset["harness"]).first() or catalog_services.create_harness(
        user, name=preset["harness"], description="Demo: CALC/RESULT/ANSWER word-problem agent (examples/arith)",
        command=[sys.executable, str(DEMO / "agent.py"), "--task", "{task_file}", "--out", "{output_file}"],
        env={}, timeout_s=300)
    dataset = Dataset.objects.filter(owner=user, name=preset["dataset"]).first() or catalog_services.create_dataset(
        user, name=preset["dataset"], content=(DEMO / "tasks.jsonl").read_bytes(), filename="tasks.jsonl",
        description="500 two-number word problems, 100 of them val: the val tasks use wordings no train task uses "
                    "(examples/arith/make_tasks.py)",
        required_fields=("question", "answer"))
    reward = RewardScript.objects.filter(owner=user, name=preset["reward_script"]).first() or \
        catalog_services.create_reward_script(user, name=preset["reward_script"], source=(DEMO / "reward.py").read_text(),
                                      description="1 for the exact number, else 0")
    return harness, dataset, reward


def ensure_repo_suite(user) -> tuple[Dataset, RewardScript]:
    """The user's repository task suite (examples/repo_tasks) and its reward script, created where missing: what
    the mini-SWE-agent and OpenCode templates' presets train on. `tests` is hidden from the harness by default."""
    dataset = Dataset.objects.filter(owner=user, name=REPO_DATASET).first() or catalog_services.create_dataset(
        user, name=REPO_DATASET, content=(REPO_TASKS / "tasks.jsonl").read_bytes(), filename="tasks.jsonl",
        description="Tiny git repositories to fix (wrong operator, off-by-one, missing return, a failing test, a "
                    "computed file, a rename); val templates (wording and scenario) differ from train ones "
                    "(examples/repo_tasks)",
        required_fields=("prompt", "files", "tests"))
    reward = RewardScript.objects.filter(owner=user, name=REPO_REWARD).first() or catalog_services.create_reward_script(
        user, name=REPO_REWARD, source=(REPO_TASKS / "reward.py").read_text(),
        description="The fraction of the task's hidden checks that pass on the agent's final files")
    return dataset, reward


def start_demo_run(user) -> Run:
    """A queued run of the preset for `user` (the demo rows are created first where missing).

    Raises common_errors.ServiceError when it cannot be created, e.g. the model is not in the registry yet.
    """
    preset = demo_preset()
    harness, dataset, reward = ensure_demo(user)
    return services.create_run(user, name=preset["name"], model=preset["model"],
                               config=presets.tag(preset["config"], presets.DEMO_SLUG),
                               harness=harness, dataset=dataset, reward_script=reward)


def first_superuser():
    """The user `manage.py up` creates and logs in as."""
    return get_user_model().objects.filter(is_superuser=True).order_by("pk").first()


class Command(BaseCommand):
    help = ("Create the arithmetic demo (harness, dataset, reward script) and the repository task suite (dataset, "
            "reward script) for a user; existing ones are kept. "
            "With --start-run, also start the demo run and print its URL.")

    def add_arguments(self, parser):
        parser.add_argument("--username", help="the user (default: the first superuser, as `manage.py up` makes)")
        parser.add_argument("--start-run", action="store_true", help="start the preset run (examples/arith/preset.json)")
        parser.add_argument("--url", default="http://127.0.0.1:8000/", help="the app's address, for the printed link")
        parser.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                            help="first wait up to this long for the app to answer at --url (used by `./lw demo`)")
        parser.add_argument("--app-pid", type=int, default=0,
                            help="while waiting, give up once this process (the app starting) has exited")

    def handle(self, *args, username=None, start_run=False, url="http://127.0.0.1:8000/", wait=0.0, app_pid=0,
               **options):
        if wait:
            _wait_for_app(url, wait, app_pid)
        user = get_user_model().objects.filter(username=username).first() if username else first_superuser()
        if user is None:
            raise CommandError(f"no user named {username!r}" if username else
                               "no superuser yet: start the app once (`./lw up`) or pass --username")
        ensure_demo(user)
        ensure_repo_suite(user)
        preset = demo_preset()
        if options.get("verbosity", 1):
            self.stdout.write(f"Demo ready: harness {preset['harness']!r}, dataset {preset['dataset']!r}, "
                              f"reward {preset['reward_script']!r}; repository suite: dataset {REPO_DATASET!r}, "
                              f"reward {REPO_REWARD!r}")
        if start_run:
            try:
                run = start_demo_run(user)
            except common_errors.ServiceError as exc:
                raise CommandError(f"the demo run could not start: {exc}") from exc
            link = url.rstrip("/") + reverse("run-detail", args=[run.pk])
            self.stdout.write(self.style.SUCCESS(f"Demo run #{run.pk} ({run.model}, {run.config['steps']} steps) "
                                                 f"started for {user.username}: {link}"))


def _wait_for_app(url: str, timeout_s: float, app_pid: int = 0) -> None:
    """Block until the app's login page answers; CommandError after `timeout_s` or once `app_pid` has exited."""
    deadline = time.monotonic() + timeout_s
    while True:
        if app_pid and not procs.alive(app_pid):
            raise CommandError(f"the app (process {app_pid}) exited before it answered at {url}; see its output")
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/accounts/login/", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise CommandError(f"the app did not answer at {url} within {timeout_s:.0f} s")
        time.sleep(1)
