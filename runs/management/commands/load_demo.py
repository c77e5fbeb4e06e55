"""`manage.py load_demo --username U`: the demo harness, dataset and reward script (examples/arith) for a user."""
from __future__ import annotations

import sys

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from runs import services
from runs.models import Dataset, Harness, RewardScript

DEMO = settings.BASE_DIR / "examples" / "arith"


class Command(BaseCommand):
    help = "Create the arithmetic demo (harness, dataset, reward script) for a user; existing ones are kept."

    def add_arguments(self, parser):
        parser.add_argument("--username", required=True)

    def handle(self, *args, username, **options):
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"no user named {username!r}")
        if not Harness.objects.filter(owner=user, name="arith-agent").exists():
            services.create_harness(
                user, name="arith-agent", description="Demo: CALC/RESULT/ANSWER word-problem agent (examples/arith)",
                command=[sys.executable, str(DEMO / "agent.py"), "--task", "{task_file}", "--out", "{output_file}"],
                env={}, timeout_s=300)
        if not Dataset.objects.filter(owner=user, name="arith-word-problems").exists():
            services.create_dataset(user, name="arith-word-problems", content=(DEMO / "tasks.jsonl").read_bytes(),
                                    filename="tasks.jsonl", description="500 two-number word problems (100 val)",
                                    required_fields=("question", "answer"))
        if not RewardScript.objects.filter(owner=user, name="arith-exact").exists():
            services.create_reward_script(user, name="arith-exact", source=(DEMO / "reward.py").read_text(),
                                          description="1 for the exact number, else 0")
        if options.get("verbosity", 1):
            self.stdout.write("Demo ready: harness 'arith-agent', dataset 'arith-word-problems', reward 'arith-exact'")
