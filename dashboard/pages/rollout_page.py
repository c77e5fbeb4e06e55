"""A rollout's page (/rollouts/<id>/): its facts, output, every call as a conversation, tools, samples and group
neighbours; the raw JSON of one call; and one val task's trajectories at two evaluations side by side.

A fixed number of queries whatever the rollout's size: the calls (with their bodies, which the conversation needs,
and their token counts from the database, never the token arrays) in one query, the samples in one, the group in
one. The raw bodies are fetched per call only when asked for (`rollout-call-raw`).
"""
from __future__ import annotations

import json
from itertools import zip_longest
from typing import Any

from django.contrib.auth.decorators import login_required
from django.http import Http404, JsonResponse
from django.shortcuts import get_object_or_404, render
from django.urls import path, reverse
from django.views.decorators.http import require_GET

from catalog import selectors
from catalog.models import Split, Task
from common.db import JsonArrayLength
from dashboard import conversations
from dashboard.pages.run_page import duration_text
from dashboard.rollout_queries import CALL_COLUMNS
from runs.models import FailureKind, ModelCall, Rollout, RolloutStatus, Run, Sample
from trainer.config import TrainerConfig


@login_required
@require_GET
def rollout_detail(request, rollout_id: int):
    rollout = get_object_or_404(selectors.owned(Rollout.objects.select_related("run", "task"), request.user),
                                pk=rollout_id)
    run = rollout.run
    calls = call_views(_calls(rollout.pk))
    convs = [c["conversation"] for c in calls]
    previous, following, group = _group(rollout)
    return render(request, "runs/rollout.html", {
        "rollout": rollout, "run": run, "calls": calls, "tools": _tools(convs), "samples": _samples(rollout.pk),
        "previous": previous, "next": following, "group": group, "timings": _timings(rollout, calls),
        "task_json": _pretty(run.harness_task(rollout.task.data)) if rollout.task is not None else "",
        "reward_detail_json": _pretty(rollout.reward_detail) if rollout.reward_detail else "",
    })


@login_required
@require_GET
def rollout_call_raw(request, rollout_id: int, seq: int):
    """The verbatim request and response bodies of one call, for the page's raw JSON toggle."""
    row = (selectors.owned(ModelCall.objects.filter(rollout_id=rollout_id, seq=seq), request.user)
           .values("request", "response").first())
    if row is None:
        raise Http404("no such call")
    return JsonResponse({"rollout": rollout_id, "seq": seq, "request": row["request"], "response": row["response"]})


def _calls(rollout_id: int) -> list[dict[str, Any]]:
    return list(ModelCall.objects.filter(rollout_id=rollout_id).order_by("seq")
                .annotate(prompt_tokens=JsonArrayLength("prompt_ids"),
                          completion_tokens=JsonArrayLength("completion_ids"))
                .values(*CALL_COLUMNS, "sampling_overrides", "prompt_tokens", "completion_tokens", "request",
                        "response"))


def call_views(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each call with its conversation and the turns to show: the context turns an earlier call already showed
    (the history an agent resends) are left out and named, so a 50-call rollout reads as one conversation."""
    views: list[dict[str, Any]] = []
    for row in rows:
        conv = conversations.conversation(row.pop("api"), row.pop("request"), row.pop("response"))
        shared, source = 0, None
        for earlier in reversed(views):  # the latest earlier call wins a tie
            if len(earlier["conversation"].turns) <= shared:
                continue  # it cannot share more (an agent's earlier calls are shorter): O(calls), not O(calls²)
            count = conversations.shared_prefix(earlier["conversation"], conv)
            if count > shared:
                shared, source = count, earlier["seq"]
            if shared == len(conv.context):
                break  # no earlier call can share more
        views.append({**row, "api": conv.api, "conversation": conv, "shared": shared, "shared_with": source,
                      "turns": conv.turns[shared:]})
    return views


def _tools(convs: list[conversations.Conversation]) -> list[dict[str, Any]]:
    counts = conversations.tool_call_counts(convs)
    defined = conversations.tool_definitions(convs)
    names = {tool.name for tool in defined}
    undefined = [conversations.ToolDef(name, "called, but not among the tools offered")
                 for name in sorted(counts) if name not in names]
    return [{"tool": tool, "called": counts.get(tool.name, 0)} for tool in defined + undefined]


def _samples(rollout_id: int) -> list[dict[str, Any]]:
    rows = list(Sample.objects.filter(rollout_id=rollout_id).order_by("index")
                .annotate(tokens=JsonArrayLength("token_ids"))
                .values("pk", "index", "step", "build", "advantage", "policy_version", "call_seqs", "tokens"))
    for row in rows:
        row["url"] = reverse("sample-tokens", args=[row["pk"]])
    return rows


def _group(rollout: Rollout) -> tuple[dict | None, dict | None, list[dict]]:
    """The rollouts of the same group (same run, split, step and group; by attempt), and this one's neighbours."""
    group = list(Rollout.objects.filter(run_id=rollout.run_id, split=rollout.split, step=rollout.step,
                                        group=rollout.group).order_by("attempt", "id")
                 .values("pk", "attempt", "greedy", "status", "reward"))
    at = next(i for i, row in enumerate(group) if row["pk"] == rollout.pk)
    return (group[at - 1] if at > 0 else None), (group[at + 1] if at + 1 < len(group) else None), group


def _timings(rollout: Rollout, calls: list[dict[str, Any]]) -> dict[str, str]:
    def between(start, end) -> str:
        return duration_text((end - start).total_seconds()) if start and end else ""

    latency = sum(c["latency_ms"] for c in calls) / 1000.0
    return {"queued": between(rollout.created_at, rollout.started_at),
            "duration": between(rollout.started_at, rollout.finished_at),
            "model": duration_text(latency) if calls else ""}


def _pretty(value) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True, default=str)


# --- one val task at two evaluations -----------------------------------------------------------------------------


class _BadQuery(ValueError):
    pass


@login_required
@require_GET
def val_task_compare(request, run_id: int, task_id: int):
    """/runs/<run>/val/<task>/?a=<step>&b=<step>&attempt=<n|greedy>: the task's val attempts at two evaluation steps
    (default: the first and the last), aligned turn by turn. Without `attempt`, each side shows its first sampled
    attempt (the greedy one when that is all there is)."""
    run = get_object_or_404(selectors.owned(Run.objects.all(), request.user), pk=run_id)
    task = get_object_or_404(Task.objects.filter(dataset_id=run.dataset_id), pk=task_id)
    attempts = list(Rollout.objects.filter(run=run, split=Split.VAL, task=task).order_by("step", "greedy", "attempt")
                    .values("pk", "step", "attempt", "greedy", "status", "reward", "failure_kind", "call_count"))
    steps = sorted({row["step"] for row in attempts})
    try:
        a, b = (_step(request.GET, key, steps, default) for key, default in (("a", 0), ("b", -1)))
        attempt = _attempt(request.GET.get("attempt", ""))
    except _BadQuery as exc:
        return render(request, "runs/val_task_compare.html", {"run": run, "task": task, "error": str(exc)},
                      status=400)
    threshold = float((run.config or {}).get("pass_threshold", TrainerConfig.pass_threshold))
    sides = [_side(attempts, step, attempt, threshold) for step in (a, b)]
    trajectories = _trajectories([s["rollout"]["pk"] for s in sides if s["rollout"]])
    turns = [trajectories.get(s["rollout"]["pk"], []) if s["rollout"] else [] for s in sides]
    rows = [{"index": i, "a": [ta] if ta else [], "b": [tb] if tb else []}
            for i, (ta, tb) in enumerate(zip_longest(*turns))]
    return render(request, "runs/val_task_compare.html", {
        "run": run, "task": task, "steps": steps, "a": a, "b": b, "attempt": request.GET.get("attempt", ""),
        "attempt_choices": sorted({r["attempt"] for r in attempts if not r["greedy"]}),
        "has_greedy": any(r["greedy"] for r in attempts), "rows": rows,
        "sides": [{**side, "cls": f"side-{label.lower()}", "label": label} for side, label in zip(sides, "AB")],
        "pass_threshold": threshold,
    })


def _step(params, key: str, steps: list[int], default: int) -> int | None:
    value = params.get(key, "")
    if value == "":
        return steps[default] if steps else None
    try:
        return int(value)
    except ValueError:
        raise _BadQuery(f"{key} must be an evaluation step (a whole number), got {value!r}") from None


def _attempt(value: str) -> int | str | None:
    if value in ("", "greedy"):
        return value or None
    try:
        return int(value)
    except ValueError:
        raise _BadQuery(f"attempt must be a whole number or 'greedy', got {value!r}") from None


def _side(attempts: list[dict], step: int | None, attempt: int | str | None, threshold: float) -> dict[str, Any]:
    at_step = [r for r in attempts if r["step"] == step]
    if attempt == "greedy":
        chosen = next((r for r in at_step if r["greedy"]), None)
    elif attempt is not None:
        chosen = next((r for r in at_step if r["attempt"] == attempt and not r["greedy"]), None)
    else:  # ordered sampled first, then greedy
        chosen = at_step[0] if at_step else None
    passed = None
    if chosen is not None and chosen["status"] in (RolloutStatus.SUCCEEDED, RolloutStatus.FAILED) \
            and chosen["failure_kind"] != FailureKind.INFRA:
        passed = chosen["status"] == RolloutStatus.SUCCEEDED and (chosen["reward"] or 0.0) >= threshold
    return {"step": step, "rollout": chosen, "passed": passed}


def _trajectories(rollout_ids: list[int]) -> dict[int, list[conversations.Turn]]:
    """Each rollout's calls as one trajectory (one query): every call's new turns and completion, in order."""
    rows = (ModelCall.objects.filter(rollout_id__in=rollout_ids).order_by("rollout_id", "seq")
            .values("rollout_id", "seq", "api", "request", "response"))
    by_rollout: dict[int, list[dict]] = {}
    for row in rows:
        by_rollout.setdefault(row.pop("rollout_id"), []).append(row)
    return {pk: [turn for view in call_views(calls) for turn in view["turns"]] for pk, calls in by_rollout.items()}


urlpatterns = [
    path("rollouts/<int:rollout_id>/", rollout_detail, name="rollout-detail"),
    path("rollouts/<int:rollout_id>/calls/<int:seq>.json", rollout_call_raw, name="rollout-call-raw"),
    path("runs/<int:run_id>/val/<int:task_id>/", val_task_compare, name="val-task-compare"),
]
