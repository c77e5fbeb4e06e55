"""`manage.py load_harness_templates`: the ready-made harnesses of examples/harnesses/ for a user (or every user)."""
from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from catalog import harness_templates
from runs.management.commands.load_demo import first_superuser


class Command(BaseCommand):
    help = ("Give a user (default: the first superuser) every harness template of examples/harnesses/ as a harness "
            "of their own; existing harnesses with a template's name are kept.")

    def add_arguments(self, parser):
        parser.add_argument("--username", help="the user (default: the first superuser)")
        parser.add_argument("--all-users", action="store_true", help="every active user")

    def handle(self, *args, username=None, all_users=False, **options):
        users = get_user_model().objects.filter(is_active=True) if all_users else [
            get_user_model().objects.filter(username=username).first() if username else first_superuser()]
        if not all_users and users[0] is None:
            raise CommandError(f"no user named {username!r}" if username else "no superuser yet: pass --username")
        installed = harness_templates.installed_versions()
        for user in users:
            made = harness_templates.ensure_for(user)
            if options.get("verbosity", 1):
                self.stdout.write(f"{user.username}: {len(made)} harness templates added "
                                  f"({', '.join(h.name for h in made) or 'all present'})")
        missing = sorted({t.tool for t in harness_templates.templates()} - installed.keys())
        if missing and options.get("verbosity", 1):
            self.stdout.write(f"Agents not installed yet: {', '.join(missing)} "
                              f"(scripts/install-harnesses; they go to {harness_templates.tools_dir()})")
