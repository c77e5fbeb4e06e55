"""`manage.py disk [--free]`: what the runs hold on disk and what could go (runs.disk); --free removes it."""
from __future__ import annotations

from django.core.management.base import BaseCommand

from runs import disk


def _mb(size: int) -> str:
    return f"{size / 2**20:,.1f} MB"


class Command(BaseCommand):
    help = ("Report the disk the runs use (run folders by part, served model folders) and what could be freed: "
            "folders of deleted runs, workdirs of finished rollouts (failed ones past LIGHTNING_FAILED_WORKDIRS_KEPT "
            "or LIGHTNING_FAILED_WORKDIRS_MAX_AGE_H), finished runs' engine weights, served folders of models that "
            "are gone. --free removes them.")

    def add_arguments(self, parser):
        parser.add_argument("--free", action="store_true", help="remove what the report lists as reclaimable")

    def handle(self, *args, free=False, **options):
        report = disk.plan()
        self.stdout.write(f"run folders ({len(report.runs)}):")
        for name, size, parts in report.runs:
            shown = ", ".join(f"{part} {_mb(bytes_)}" for part, bytes_ in sorted(parts.items()))
            self.stdout.write(f"  {name:14} {_mb(size):>12}  {shown}")
        self.stdout.write(f"served model folders in use: {_mb(report.served)}")
        self.stdout.write(f"held in all: {_mb(report.held)}")
        self.stdout.write(f"reclaimable ({len(report.reclaimable)}):")
        for item in report.reclaimable:
            self.stdout.write(f"  {_mb(item.size):>12}  {item.path}  ({item.why})")
        if free:
            freed = disk.free(report.reclaimable)
            self.stdout.write(f"freed {_mb(freed)}")
        else:
            self.stdout.write(f"would free {_mb(report.freeable)}; run with --free to remove it")
