"""Reads behind the run inspector: the validation grid with its flips, a training step's GRPO groups and what it
dropped, and the step's rollout timeline. A fixed number of queries whatever the run's size; no call JSON blob read.

Validation grid (built on selectors.validation_grid, two aggregate queries):
- a cell is the task's sampled attempts at one evaluation: 'pass' when all that count passed, 'fail' when none did,
  'partial' in between (its text is the fraction), 'missing' when none counts (not evaluated, still running, or all
  lost to infrastructure). The greedy attempt is a marker beside it (`greedy`: True, False or None); it decides the
  cell only where no sampled attempt counts.
- a cell is *solved* when at least one attempt passed (pass@k). Flags compare solved states over the cells that are
  not missing: `flipped` = solved changed between two consecutive evaluations (either way); `fail_to_pass` /
  `pass_to_fail` = the first and the last evaluation differ that way; `never_solved` = no evaluation solved it.

Step data (step N): the rollouts sampled for step N, trained or dropped (Rollout.batch_step). Runs recorded before
the step of a rollout's batch was stored fall back to the rollouts launched at policy version N - 1 (Rollout.step),
which is the step's batch exactly in sync mode. Staleness of a sample = (N - 1) - Sample.policy_version: the trainer's version
before the update minus the newest version that sampled its tokens. Staleness never drops a sample: the scheduler
forces a group into a batch when it reaches max_staleness.
"""
from __future__ import annotations

from typing import Any

from django.db.models import Max, Min, Q
from django.db.models.functions import Substr

from catalog.models import Split
from runs import events, selectors
from runs.models import FailureKind, Metric, ModelCall, Rollout, Run, RunEvent, Sample
from trainer.config import TrainerConfig
from trainer.samples import drop_reason

FLAGS = ("flipped", "fail_to_pass", "pass_to_fail", "never_solved")
ERROR_PREVIEW = 300
STEP_METRICS = ("reward/mean", "reward/pass_rate", "groups/total", "groups/with_signal", "samples/trained",
                "samples/dropped_rollouts", "time/step", "staleness/max")


# ---- validation grid ------------------------------------------------------------------------------------------

def val_grid(run: Run) -> dict[str, Any]:
    """selectors.validation_grid with each cell's state and text and each task's flags (see the module doc)."""
    grid = selectors.validation_grid(run)
    for task in grid["tasks"]:
        shown = [_cell_state(cell) for cell in task["cells"]]
        task["states"] = [state for state, _, _ in shown]
        task["texts"] = [text for _, text, _ in shown]
        task.update(_flags([solved for _, _, solved in shown]))
    grid["counts"] = {flag: sum(t[flag] for t in grid["tasks"]) for flag in FLAGS}
    grid["counts"]["all"] = len(grid["tasks"])
    return grid


def _cell_state(cell: dict | None) -> tuple[str, str, bool | None]:
    """(class, text, solved) of a cell; solved is None where the cell says nothing."""
    if cell is None:
        return "missing", "·", None
    if cell["attempts"]:
        passed, attempts = cell["passed"], cell["attempts"]
        if passed == attempts:
            return "pass", "✓", True
        if passed == 0:
            return "fail", "✗", False
        return "partial", f"{passed}/{attempts}", True
    if cell["greedy"] is not None:
        return ("pass", "✓", True) if cell["greedy"] else ("fail", "✗", False)
    return "missing", "…" if cell["unscored"] else "·", None


def _flags(states: list[bool | None]) -> dict[str, Any]:
    seen = [s for s in states if s is not None]
    flipped = any(a != b for a, b in zip(seen, seen[1:]))
    return {"flipped": flipped,
            "fail_to_pass": len(seen) > 1 and not seen[0] and seen[-1],
            "pass_to_fail": len(seen) > 1 and seen[0] and not seen[-1],
            "never_solved": bool(seen) and not any(seen)}


# ---- training steps -------------------------------------------------------------------------------------------

def step_list(run: Run) -> list[dict[str, Any]]:
    """The run's trained steps (1..) with the metrics the run page lists beside each: one query."""
    steps: dict[int, dict[str, float]] = {}
    for step, name, value in (Metric.objects.filter(run=run, step__gte=1, name__in=STEP_METRICS)
                              .values_list("step", "name", "value")):
        steps.setdefault(step, {})[name] = value
    return [{"step": step, "metrics": values} for step, values in sorted(steps.items())]


def _legacy(run: Run) -> bool:
    """A run recorded before Rollout.batch_step (trained_step, as it was then): no rollout of it has one."""
    return not Rollout.objects.filter(run=run, batch_step__isnull=False).exists()


def step_rollouts(run: Run, step: int, legacy: bool | None = None):
    """The rollouts of step `step`'s batch (see the module doc for runs recorded before batch_step)."""
    if legacy is None:
        legacy = _legacy(run)
    rows = Rollout.objects.filter(run=run)
    if legacy:
        return rows.filter(split=Split.TRAIN, step=step - 1)
    return rows.filter(batch_step=step)


def step_data(run: Run, step: int) -> dict[str, Any]:
    """Step `step`: its groups (task, each attempt's reward, trained reward and advantages, no-signal groups), what
    it dropped and flagged, and its timeline. Six queries."""
    config = {**TrainerConfig().to_dict(), **(run.config or {})}
    failure_reward = float(config.get("failure_reward", 0.0))
    legacy = _legacy(run)
    batch = step_rollouts(run, step, legacy)
    rollouts = list(batch.order_by("group", "attempt", "id").annotate(error_preview=Substr("error", 1, ERROR_PREVIEW))
                    .values("id", "group", "attempt", "status", "reward", "failure_kind", "drop_reason", "step",
                            "policy_version", "call_count", "started_at", "finished_at", "error_preview",
                            "task_id", "task__external_id"))
    samples = list(Sample.objects.filter(rollout__in=batch.values("pk")).order_by("rollout_id", "index")
                   .values("id", "rollout_id", "index", "advantage", "policy_version", "build", "step"))
    calls = list(ModelCall.objects.filter(rollout__in=batch.values("pk"))
                 # a call that failed before any token has a status or an error to say so (no JSON read here)
                 .filter(~Q(status_code=200) | ~Q(error="") | Q(finish_reason="length"))
                 .order_by("rollout_id", "seq").annotate(error_preview=Substr("error", 1, ERROR_PREVIEW))
                 .values("rollout_id", "seq", "status_code", "finish_reason", "drift", "error_preview"))
    by_rollout: dict[int, list[dict]] = {}
    for s in samples:
        by_rollout.setdefault(s["rollout_id"], []).append(
            {"id": s["id"], "index": s["index"], "advantage": s["advantage"], "build": s["build"],
             "policy_version": s["policy_version"], "staleness": step - 1 - s["policy_version"]})
    attempts = [_attempt(r, by_rollout.get(r["id"], []), failure_reward) for r in rollouts]
    groups = _groups(attempts)
    return {"run": run.pk, "step": step, "legacy": legacy, "failure_reward": failure_reward,
            "dynamic_sampling": bool(config.get("dynamic_sampling")),
            "groups_dropped_no_signal": sum(g["dropped_no_signal"] for g in groups),
            "max_staleness": config.get("max_staleness"), "mode": config.get("mode"),
            "groups": groups, **_dropped(attempts, calls), "timeline": _timeline(run, step, attempts)}


def _attempt(r: dict, samples: list[dict], failure_reward: float) -> dict[str, Any]:
    kind = r["failure_kind"]
    # as scheduler.reward_of: a policy failure counts with failure_reward, an infrastructure failure not at all
    counted = kind == FailureKind.POLICY or (kind != FailureKind.INFRA and r["reward"] is not None)
    trained_reward = failure_reward if kind == FailureKind.POLICY else r["reward"]
    return {"rollout": r["id"], "group": r["group"], "attempt": r["attempt"], "task": r["task_id"],
            "task_external_id": r["task__external_id"] or "", "status": r["status"], "reward": r["reward"],
            "trained_reward": trained_reward if counted else None, "counted": counted, "failure_kind": kind,
            "drop_reason": r["drop_reason"], "launched_at_version": r["step"], "calls": r["call_count"],
            "error": r["error_preview"] or "", "samples": samples,
            "advantages": [s["advantage"] for s in samples],
            "started_at": _iso(r["started_at"]), "finished_at": _iso(r["finished_at"])}


def _groups(attempts: list[dict]) -> list[dict[str, Any]]:
    """GRPO groups in order; a group gives no signal when its counted trained rewards are all equal (or none
    counts): every advantage is zero, as step_metrics.rollout_metrics' groups/with_signal counts it."""
    groups: dict[int, dict[str, Any]] = {}
    for a in attempts:
        g = groups.setdefault(a["group"], {"group": a["group"], "task": a["task"],
                                           "task_external_id": a["task_external_id"], "attempts": []})
        g["attempts"].append(a)
    for g in groups.values():
        rewards = [a["trained_reward"] for a in g["attempts"] if a["counted"]]
        g["rewards"] = rewards
        g["no_signal"] = not rewards or max(rewards) == min(rewards)
        # dynamic sampling dropped it: recorded with the step, never trained (another task took its place)
        g["dropped_no_signal"] = any(a["drop_reason"].startswith("no_signal") for a in g["attempts"])
        g["reward_mean"] = sum(rewards) / len(rewards) if rewards else None
    return list(groups.values())


def _dropped(attempts: list[dict], calls: list[dict]) -> dict[str, Any]:
    """Rollouts of the step that gave no trained sample (with their reason), calls that failed before any token
    (trained on nothing: build_samples forks past them), and truncated completions (trained, but flagged)."""
    dropped = []
    for a in attempts:
        reason = a["drop_reason"]
        if not reason and not a["samples"]:  # a run recorded before drop_reason: say what the row shows
            reason = drop_reason(a["failure_kind"], a["error"])
        if reason:
            dropped.append({"rollout": a["rollout"], "group": a["group"], "attempt": a["attempt"],
                            "reason": reason, "kind": reason.split(":", 1)[0]})
    failed_calls, truncated = [], []
    for c in calls:
        entry = {"rollout": c["rollout_id"], "seq": c["seq"], "status_code": c["status_code"],
                 "finish_reason": c["finish_reason"], "drift": c["drift"], "error": c["error_preview"] or ""}
        if c["finish_reason"] == "length" and c["status_code"] == 200:
            truncated.append(entry)
        else:
            failed_calls.append(entry)
    return {"dropped": dropped, "failed_calls": failed_calls, "truncated": truncated,
            "staleness_note": "staleness never drops a sample: a group at max_staleness is forced into the next "
                              "batch"}


# ---- timeline ---------------------------------------------------------------------------------------------------

def _timeline(run: Run, step: int, attempts: list[dict]) -> dict[str, Any]:
    """Bars (launch to reward) of the step's rollouts and the run's phases over the step's window: from the
    previous step's first run.metrics event (its training record; step 0's evaluation for step 1) to this step's
    first one. The previous step's evaluation therefore lies in this step's window, as it held this step up."""
    bounds = RunEvent.objects.filter(run=run, kind=events.RUN_METRICS).aggregate(
        start_seq=Min("seq", filter=Q(payload__step=step - 1)),
        start_at=Min("created_at", filter=Q(payload__step=step - 1)),
        end_seq=Min("seq", filter=Q(payload__step=step)), end_at=Min("created_at", filter=Q(payload__step=step)),
        last_seq=Max("seq"))
    start_seq = bounds["start_seq"] or 0
    end_seq = bounds["end_seq"]
    phases = RunEvent.objects.filter(run=run, kind=events.RUN_PHASE, seq__gt=start_seq)
    if end_seq is not None:
        phases = phases.filter(seq__lt=end_seq)
    rows = list(phases.order_by("seq").values("created_at", "payload"))
    bands: list[dict[str, Any]] = []
    for row in rows:
        text = str((row["payload"] or {}).get("phase", ""))
        if not text:
            continue
        name, kind = _phase_name(text)
        at = _iso(row["created_at"])
        if bands and bands[-1]["name"] == name:
            continue  # progress of the same phase ('evaluating step 3: 10/40', '...: 20/40')
        if bands:
            bands[-1]["end"] = at
        bands.append({"name": name, "kind": kind, "start": at, "end": None})
    end = _iso(bounds["end_at"])
    if bands and bands[-1]["end"] is None:
        bands[-1]["end"] = end or max([a["finished_at"] for a in attempts if a["finished_at"]], default=None)
    bars = [{"rollout": a["rollout"], "group": a["group"], "attempt": a["attempt"], "start": a["started_at"],
             "end": a["finished_at"], "reward": a["reward"], "failure_kind": a["failure_kind"],
             "dropped": bool(a["drop_reason"])} for a in attempts if a["started_at"]]
    finished = sorted((b for b in bars if b["end"]), key=lambda b: b["end"])
    late = {b["rollout"] for b in finished[len(finished) - max(1, len(finished) // 10):]} if finished else set()
    for b in bars:  # the last tenth to finish (at least one) held the step up
        b["straggler"] = b["rollout"] in late
    return {"window": {"start": _iso(bounds["start_at"]), "end": end}, "bands": bands, "bars": bars}


def _phase_name(text: str) -> tuple[str, str]:
    """The phase without its progress ('evaluating step 3: 10/40' -> 'evaluating step 3') and its kind for the
    band's colour: generate, train, sync, eval, checkpoint, record or other (trainer.step_metrics and
    runs.evaluation write these texts)."""
    lower = text.lower()
    name = text.split(": ")[0] if lower.startswith("evaluating") else text
    for kind, marker in (("eval", "evaluating"), ("generate", "generating"), ("train", "training"),
                         ("sync", "syncing"), ("checkpoint", "checkpoint"), ("record", "recording")):
        if marker in lower:
            return name, kind
    return name, "other"


def _iso(moment) -> str | None:
    return moment.isoformat() if moment else None
