"""`manage.py up`: migrate, make sure a first user exists, then supervise web + worker until stopped."""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from rest_framework.authtoken.models import Token

from runs.management.commands.models import ensure_smollm2


class Command(BaseCommand):
    help = "Set up the database and first user, then run the web server and a Celery worker."

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1", help="address the web server binds (0.0.0.0 for all)")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--no-worker", action="store_true", help="do not start a Celery worker")
        parser.add_argument("--no-demo", action="store_true", help="do not load the demo harness, dataset and reward")
        parser.add_argument("--exit-when-ready", action="store_true",
                            help="stop everything once the login page answers (a smoke check)")

    def handle(self, *args, **options):
        self.stdout.write("Applying database migrations ...")
        call_command("migrate", interactive=False, verbosity=0)
        call_command("collectstatic", interactive=False, verbosity=0)
        user = self._first_user()
        if not options["no_demo"]:
            ensure_smollm2(self.stdout.write)
            call_command("load_demo", username=user.username, verbosity=1)
        children = self._start(options)
        url = f"http://{'127.0.0.1' if options['host'] in ('0.0.0.0', '::') else options['host']}:{options['port']}/"
        try:
            self._wait_ready(url, children)
            self.stdout.write(self.style.SUCCESS(f"\nlightning-web is running at {url}"))
            self.stdout.write(f"  API docs: {url}api/docs/   Redis: {settings.REDIS_URL}   data: {settings.DATA_DIR}")
            if options["exit_when_ready"]:
                return
            self.stdout.write("Press Ctrl-C to stop.")
            self._supervise(children)
        finally:
            self._stop(children)

    def _first_user(self):
        User = get_user_model()
        password_file = settings.DATA_DIR / "admin_password"
        user = User.objects.filter(is_superuser=True).order_by("pk").first()
        if user is None:
            password = secrets.token_urlsafe(12)
            user = User.objects.create_superuser("admin", "admin@localhost", password)
            password_file.write_text(password + "\n")
            password_file.chmod(0o600)
        token, _ = Token.objects.get_or_create(user=user)
        password = password_file.read_text().strip() if password_file.exists() else "(set by you)"
        self.stdout.write(self.style.SUCCESS(f"Log in as: {user.username} / {password}"))
        self.stdout.write(f"API token of {user.username}: {token.key}")
        return user

    def _start(self, options) -> dict[str, subprocess.Popen]:
        python = sys.executable
        env = dict(os.environ, REDIS_URL=settings.REDIS_URL, LIGHTNING_DATA_DIR=str(settings.DATA_DIR))
        web = [python, "-m", "daphne", "-b", options["host"], "-p", str(options["port"]),
               "lightning_web.asgi:application"]
        children = {"web": subprocess.Popen(web, env=env, start_new_session=True)}
        if not options["no_worker"]:
            worker = [python, "-m", "celery", "-A", "lightning_web", "worker", "-Q", "runs,default",
                      "--pool", "solo", "--loglevel", "INFO", "-n", f"runs@{os.uname().nodename}"]
            children["worker"] = subprocess.Popen(worker, env=env, start_new_session=True)
        return children

    def _wait_ready(self, url: str, children, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_alive(children)
            try:
                with urllib.request.urlopen(url + "accounts/login/", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        raise CommandError(f"the web server did not answer at {url} within {timeout_s:.0f} s")

    def _supervise(self, children) -> None:
        stop = {"now": False}
        previous = signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
        try:
            while not stop["now"]:
                self._check_alive(children)
                time.sleep(1)
        except KeyboardInterrupt:
            pass
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _check_alive(self, children) -> None:
        for name, proc in children.items():
            if proc.poll() is not None:
                raise CommandError(f"the {name} process exited with code {proc.returncode}; see its output above")

    def _stop(self, children) -> None:
        for proc in children.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in children.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
