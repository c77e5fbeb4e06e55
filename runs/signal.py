"""Learning signal of a run, step by step: how many of the groups it sampled had attempts that scored differently
(the only ones GRPO-family estimators learn from), what dynamic sampling dropped and spent, and the run page's
notice when the share falls (a policy going deterministic flattens the curve a few steps later).

Read from the step metrics the scheduler records (trainer.scheduler: groups/*); a run recorded before dynamic
sampling has only groups/total and groups/with_signal, which give the sampled share as well.
static/js/run_events.js draws the same notice live from the same metrics, with the same window and threshold.
"""
from __future__ import annotations

from typing import Any

from runs import selectors
from runs.models import Run

LOW_SHARE = 0.5
"""The notice shows when the mean share of sampled groups with signal over the last WINDOW steps is below this."""
WINDOW = 2

METRICS = ("groups/total", "groups/with_signal", "groups/sampled", "groups/trained", "groups/trained_with_signal",
           "groups/dropped_no_signal", "groups/signal_share", "groups/sampled_signal_share", "rollout/extra")


def sampled_share(values: dict[str, float]) -> float | None:
    """The share of a step's sampled groups with signal; None for a step that sampled none (or a metric-less one)."""
    if "groups/sampled_signal_share" in values:
        return values["groups/sampled_signal_share"]
    total = values.get("groups/total")
    return values.get("groups/with_signal", 0.0) / total if total else None


def metrics_by_step(run: Run, names, step_min: int | None = None) -> dict[int, dict[str, float]]:
    """step -> metric name -> value of the run's metrics `names` (from step `step_min` on), in one query."""
    by_step: dict[int, dict[str, float]] = {}
    for name, step, value in selectors.run_metrics(run, list(names), step_min=step_min).values_list(
            "name", "step", "value"):
        by_step.setdefault(step, {})[name] = value
    return by_step


def step_figures(run: Run, by_step: dict[int, dict[str, float]] | None = None) -> list[dict[str, Any]]:
    """One row a step: groups sampled, with signal, trained, trained with signal, dropped without signal, the
    extra rollouts spent, the trained share (what the update learnt from) and the sampled share.

    `by_step` (step -> metric name -> value, METRICS among them) spares the query when the caller read them."""
    if by_step is None:
        by_step = metrics_by_step(run, METRICS)
    rows = []
    for step in sorted(by_step):
        v = by_step[step]
        if not set(v) & set(METRICS):
            continue
        sampled = v.get("groups/sampled", v.get("groups/total"))
        with_signal = v.get("groups/with_signal")
        trained = v.get("groups/trained", sampled)
        rows.append({
            "step": step, "groups_sampled": _int(sampled), "groups_with_signal": _int(with_signal),
            "groups_trained": _int(trained),
            "groups_trained_with_signal": _int(v.get("groups/trained_with_signal", with_signal)),
            "groups_dropped_no_signal": _int(v.get("groups/dropped_no_signal", 0.0)),
            "extra_rollouts": _int(v.get("rollout/extra", 0.0)),
            "signal_share": v.get("groups/signal_share", sampled_share(v)),
            "sampled_signal_share": sampled_share(v),
        })
    return rows


def _int(value: float | None) -> int | None:
    return None if value is None else int(round(value))


def notice(rows: list[dict[str, Any]], dynamic_sampling: bool) -> dict[str, Any] | None:
    """The run page's warning when the last WINDOW steps' sampled groups mostly had no signal, else None."""
    recent = [r for r in rows if r["sampled_signal_share"] is not None][-WINDOW:]
    if len(recent) < WINDOW:
        return None
    share = sum(r["sampled_signal_share"] for r in recent) / len(recent)
    if share >= LOW_SHARE:
        return None
    first, last = recent[0]["step"], recent[-1]["step"]
    percent = int(share * 100 + 0.5)  # rounded as the page's script rounds it (Math.round)
    text = (f"Groups are losing their learning signal: in steps {first}-{last}, {percent}% of the groups sampled "
            "had attempts that scored differently. GRPO learns only from those, so the reward curve will flatten.")
    dropped = sum(r["groups_dropped_no_signal"] or 0 for r in recent)
    if dynamic_sampling:
        text += f" Dynamic sampling dropped {dropped} group{'s' if dropped != 1 else ''} without signal in these steps."
    else:
        text += " Clone the run with dynamic_sampling on, or raise temperature or group_size."
    return {"share": share, "steps": [first, last], "text": text}


def summary(run: Run, by_step: dict[int, dict[str, float]] | None = None) -> dict[str, Any]:
    """The signal of the run: the per-step rows and the notice (None when fine); `by_step` as in step_figures."""
    rows = step_figures(run, by_step)
    dynamic = bool((run.config or {}).get("dynamic_sampling", False))
    return {"dynamic_sampling": dynamic, "low_share": LOW_SHARE, "window": WINDOW, "steps": rows,
            "notice": notice(rows, dynamic)}
