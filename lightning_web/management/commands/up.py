"""`manage.py up`: migrate, make sure a first user exists, then supervise web + workers until stopped."""
from __future__ import annotations

import os
import secrets
import signal
import sys
import time
import urllib.request

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from rest_framework.authtoken.models import Token

from catalog.management.commands.models import ensure_smollm2
from lightning_web import embedded_redis
from lightning_web.supervisor import Supervisor

QUIET_LOGGERS = ("celery.app.trace", "celery.worker.strategy", "celery.beat", "celery.worker.consumer.mingle", "httpx")
"""Held at WARNING in the children (LIGHTNING_QUIET_LOGGERS): Celery's received and succeeded lines of every task and
beat's line for every send (the sweep of lost runs printed three every LIGHTNING_SWEEP_EVERY_S, finding nothing),
mingle's start-up chatter, and httpx's line per request (every model call a run makes through the proxy). Their
warnings and errors still print; runs starting and ending are logged by runs.services."""


class Command(BaseCommand):
    help = ("Set up the database and first user, then run the web server and the Celery workers (runs, and the "
            "control worker with beat that reclaims runs of lost workers); a child that dies is restarted.")

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1", help="address the web server binds (0.0.0.0 for all)")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--no-worker", action="store_true", help="do not start the Celery workers")
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
            call_command("load_harness_templates", username=user.username, verbosity=1)
        children = self._start(options)
        url = f"http://{'127.0.0.1' if options['host'] in ('0.0.0.0', '::') else options['host']}:{options['port']}/"
        try:
            self._wait_ready(url, children)
            self.stdout.write(self.style.SUCCESS(f"\nlightning-web is running at {url}"))
            self.stdout.write(f"  API docs: {url}api/docs/   Redis: {embedded_redis.redacted(settings.REDIS_URL)}   "
                              f"data: {settings.DATA_DIR}")
            if options["exit_when_ready"]:
                return
            self.stdout.write("Press Ctrl-C to stop.")
            self._supervise(children)
        finally:
            children.stop()
            if not os.environ.get("REDIS_URL"):  # the data dir's embedded Redis (settings started it): ours to stop
                embedded_redis.stop(settings.DATA_DIR)

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

    def _start(self, options) -> Supervisor:
        argvs = child_argvs(options["host"], options["port"], workers=not options["no_worker"])
        children = Supervisor(argvs, env=child_env(), say=self.stdout.write)
        children.start()
        self.stdout.write("started " + ", ".join(f"{name} (pid {children.pid(name)})" for name in argvs))
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

    def _supervise(self, children: Supervisor) -> None:
        """Until SIGTERM or Ctrl-C: a child that dies is restarted with backoff; the others keep running."""
        stop = {"now": False}
        previous = signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
        try:
            children.run(lambda: stop["now"])
        except KeyboardInterrupt:
            pass
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _check_alive(self, children: Supervisor) -> None:
        """While starting up, a child that dies is a setup error: stop and say so."""
        for child in children.dead():
            raise CommandError(f"the {child.name} process exited with code {child.proc.returncode} while starting; "
                               "see its output above")


def child_argvs(host: str, port: int, workers: bool = True) -> dict[str, list[str]]:
    """The command line of each child: the web server, and unless `workers` is false the two Celery workers."""
    python = sys.executable
    # --quiet: no banner, which would push the URL and login printed above off the screen.
    celery = [python, "-m", "celery", "-A", "lightning_web", "--quiet", "worker", "--pool", "solo",
              "--loglevel", "INFO"]
    argvs = {"web": [python, "-m", "daphne", "-b", host, "-p", str(port), "lightning_web.asgi:application"]}
    if workers:
        # Runs take a worker for hours: the sweep of lost runs (beat, every LIGHTNING_SWEEP_EVERY_S) gets a
        # worker of its own on the default queue, so it is never stuck behind a run.
        argvs["worker"] = celery + ["-Q", "runs", "-n", f"runs@{os.uname().nodename}"]
        argvs["control"] = celery + ["-Q", "default", "--beat", "-n", f"control@{os.uname().nodename}"]
    return argvs


def child_env() -> dict[str, str]:
    """The environment of `up`'s children: this process's Redis and data dir, and QUIET_LOGGERS unless set."""
    env = dict(os.environ, REDIS_URL=settings.REDIS_URL, LIGHTNING_DATA_DIR=str(settings.DATA_DIR))
    env.setdefault("LIGHTNING_QUIET_LOGGERS", ",".join(QUIET_LOGGERS))
    return env
