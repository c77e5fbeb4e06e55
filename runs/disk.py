"""Disk the runs use, and reclaiming it: rollout workdirs, run folders, served model folders.

A run's files live in LIGHTNING_RUNS_DIR/run-<id>: `rollouts/<rollout id>` (each attempt's workdir), `checkpoints`,
and `engine` (its log and the weights it syncs). Served model folders (LIGHTNING_ENGINE_CACHE_DIR/models) are shared
by every run of a model; one staged from a run's own checkpoint belongs to that run alone.

- A rollout's workdir goes once the rollout is recorded, but for failed ones: the newest
  LIGHTNING_FAILED_WORKDIRS_KEPT of each run, younger than LIGHTNING_FAILED_WORKDIRS_MAX_AGE_H, stay for debugging.
  Only workdirs marked failed (FAILED_MARK, written once their attempt is recorded) are ever pruned: the others
  under `rollouts/` may belong to attempts still running.
- Deleting a run removes its folder and the served folders of its checkpoints (delete_run_files).
- `./lw manage disk` reports what all this holds and what could go; `--free` removes it (plan / free).
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from django.conf import settings

from trainer.engine.folders import MARKER as SERVED_MARKER  # what a served folder was staged from

logger = logging.getLogger(__name__)

RUN_FOLDER = re.compile(r"run-(\d+)")


def run_folder(run_id: int) -> Path:
    return Path(settings.LIGHTNING_RUNS_DIR) / f"run-{run_id}"


def size_of(path: Path) -> int:
    """Bytes of the files under `path` (links not followed; 0 for what is gone meanwhile)."""
    if path.is_symlink() or path.is_file():
        try:
            return path.lstat().st_size
        except OSError:
            return 0
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def remove(path: Path) -> int:
    """Delete a file or folder; the bytes it held."""
    size = size_of(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
    return size


# ---- rollout workdirs -------------------------------------------------------------------------------------------


FAILED_MARK = ".lightning-failed"
"""A file in a workdir whose attempt was recorded as failed: only such workdirs are pruned while a run goes on."""


def reclaim_workdir(workdir: Path, failed: bool) -> None:
    """After a rollout is recorded: its workdir goes, unless it failed; then it is marked failed and the run's
    failed workdirs are pruned to the newest LIGHTNING_FAILED_WORKDIRS_KEPT younger than
    LIGHTNING_FAILED_WORKDIRS_MAX_AGE_H. The workdirs of attempts still running are never counted (issue 40.1: 32
    attempts in flight lost their files to one timeout). With LIGHTNING_KEEP_ROLLOUT_WORKDIRS (debugging a
    harness), every workdir stays."""
    if settings.LIGHTNING_KEEP_ROLLOUT_WORKDIRS:
        return
    if not failed:
        remove(workdir)
        return
    try:
        (workdir / FAILED_MARK).touch()  # also makes it the newest by mtime
    except OSError:  # no workdir (the harness never started): nothing to keep
        pass
    for stale in failed_workdirs_over_policy(workdir.parent):
        remove(stale)


def failed_workdirs_over_policy(rollouts_dir: Path, kept_ids: set[str] | None = None) -> list[Path]:
    """Failed rollouts' workdirs under `rollouts_dir` past the failed-workdir policy: older than the age limit, or
    beyond the newest LIGHTNING_FAILED_WORKDIRS_KEPT. The failed ones are `kept_ids` where given (folder names of
    rollouts the database says failed: the disk command), else those holding FAILED_MARK; no other folder counts."""
    keep, max_age = settings.LIGHTNING_FAILED_WORKDIRS_KEPT, settings.LIGHTNING_FAILED_WORKDIRS_MAX_AGE_H * 3600
    try:
        entries = [p for p in rollouts_dir.iterdir() if p.is_dir() and (
            p.name in kept_ids if kept_ids is not None else (p / FAILED_MARK).is_file())]
    except OSError:
        return []
    now, dated = time.time(), []
    for path in entries:
        try:
            dated.append((path.stat().st_mtime, path))
        except OSError:
            pass
    dated.sort(reverse=True)
    return [path for i, (mtime, path) in enumerate(dated) if i >= keep or now - mtime > max_age]


# ---- a deleted run's files --------------------------------------------------------------------------------------


def served_folders_of(folder: Path) -> list[Path]:
    """Served model folders staged from a model under `folder` (a run's checkpoints): used by nobody else."""
    return [served for served, source in served_folders() if source is not None and source.is_relative_to(folder)]


def served_folders() -> list[tuple[Path, Path | None]]:
    """(served folder, the model folder it was staged from) for each in the engine cache."""
    root = Path(settings.LIGHTNING_ENGINE_CACHE_DIR) / "models"
    found = []
    try:
        candidates = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    except OSError:
        return []
    for served in candidates:
        try:
            source = Path(json.loads((served / SERVED_MARKER).read_text())["source"])
        except (OSError, ValueError, KeyError, TypeError):
            source = None
        found.append((served, source))
    return found


def delete_run_files(run_id: int) -> int:
    """Remove a deleted run's folder and the served folders of its checkpoints; the bytes freed."""
    folder = run_folder(run_id)
    resolved = folder.resolve()
    freed = sum(remove(served) for served in served_folders_of(resolved))
    freed += remove(folder) if folder.exists() else 0
    logger.info("run %s deleted: %.1f MB of files freed", run_id, freed / 2**20)
    return freed


# ---- the disk command -------------------------------------------------------------------------------------------


@dataclass
class Item:
    path: Path
    size: int
    why: str


@dataclass
class Plan:
    """What the runs hold on disk and what could go."""

    runs: list[tuple[str, int, dict[str, int]]] = field(default_factory=list)  # (run folder, bytes, bytes by part)
    reclaimable: list[Item] = field(default_factory=list)
    served: int = 0  # bytes of served model folders in use

    @property
    def held(self) -> int:
        return sum(size for _, size, _ in self.runs) + self.served

    @property
    def freeable(self) -> int:
        return sum(item.size for item in self.reclaimable)


def plan() -> Plan:
    """Measure the runs dir and the served folders; list what the reclaim rules would remove."""
    from runs.models import FINISHED_RUN_STATUSES, Rollout, RolloutStatus, Run

    result = Plan()
    runs_dir = Path(settings.LIGHTNING_RUNS_DIR)
    statuses = dict(Run.objects.values_list("pk", "status"))
    try:
        folders = sorted(p for p in runs_dir.iterdir() if p.is_dir())
    except OSError:
        folders = []
    for folder in folders:
        match = RUN_FOLDER.fullmatch(folder.name)
        parts = {part.name: size_of(part) for part in folder.iterdir()} if folder.is_dir() else {}
        result.runs.append((folder.name, sum(parts.values()), parts))
        if match is None:
            continue
        run_id = int(match.group(1))
        if run_id not in statuses:
            result.reclaimable.append(Item(folder, sum(parts.values()), "its run was deleted"))
            continue
        rollouts = folder / "rollouts"
        if rollouts.is_dir():
            by_status = dict(Rollout.objects.filter(run_id=run_id).values_list("pk", "status"))
            failed = {str(pk) for pk, status in by_status.items() if status == RolloutStatus.FAILED}
            for workdir in rollouts.iterdir():
                status = by_status.get(int(workdir.name)) if workdir.name.isdigit() else None
                if status in (RolloutStatus.SUCCEEDED, RolloutStatus.CANCELLED, RolloutStatus.LOST) or (
                        status is None and statuses[run_id] in FINISHED_RUN_STATUSES):
                    result.reclaimable.append(Item(workdir, size_of(workdir), f"workdir of a {status or 'gone'} "
                                                                              "rollout"))
            for workdir in failed_workdirs_over_policy(rollouts, failed):
                result.reclaimable.append(Item(workdir, size_of(workdir), "workdir of a failed rollout past the "
                                                                          "kept count or age"))
        weights = folder / "engine" / "weights"
        if statuses[run_id] in FINISHED_RUN_STATUSES and weights.is_dir():
            result.reclaimable.append(Item(weights, size_of(weights), "engine weights of a finished run (its "
                                                                      "checkpoints keep the model)"))
    for served, source in served_folders():
        size = size_of(served)
        if source is None or not source.exists():
            result.reclaimable.append(Item(served, size, "served folder of a model that is gone"))
        else:
            result.served += size
    return result


def free(items: list[Item]) -> int:
    return sum(remove(item.path) for item in items)
