"""`manage.py worker --pool NAME` (`./lw worker --pool NAME`): a Celery worker that serves one pool (runs.pools)."""
from __future__ import annotations

import os
import shlex

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from runs import pools


class Command(BaseCommand):
    help = ("Start a Celery worker for one pool: it consumes the pool's queue (pool-NAME; 'runs' for the default "
            "pool) and runs one run per device set of LIGHTNING_DEVICE_SETS, each with CUDA_VISIBLE_DEVICES set.")

    def add_arguments(self, parser):
        parser.add_argument("--pool", default=pools.DEFAULT_POOL, help="one of LIGHTNING_POOLS")
        parser.add_argument("--name", default="", help="the Celery node name (default: pool-NAME@HOST)")
        parser.add_argument("--loglevel", default="INFO")
        parser.add_argument("--print", action="store_true", help="print the Celery command instead of running it")

    def handle(self, *args, **options):
        try:
            argv = pools.worker_argv(options["pool"], options["name"], options["loglevel"])
        except (ValueError, ImproperlyConfigured) as exc:
            raise CommandError(str(exc)) from None
        if options["print"]:
            self.stdout.write(shlex.join(argv))
            return
        self.stdout.write(f"worker for pool {options['pool']}: {shlex.join(argv[1:])}")
        self.stdout.flush()
        os.execv(argv[0], argv)
