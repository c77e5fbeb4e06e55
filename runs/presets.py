"""Run presets: the demo's (examples/arith/preset.json) and each harness template's ("preset" in its
.harness.json). The new-run form fills itself from one (`?preset=<slug>`) and shows, beside its attempts per task
and temperature, the learning-signal share of the user's last run of that preset.

A run made from a preset carries its slug in `config.extra.preset` (the form, the demo button, `./lw demo` and the
learning benches all set it); that is how "the last run with this preset" is found.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from catalog import harness_templates
from runs import signal
from runs.models import Run

DEMO_SLUG = "arith-demo"
DEMO_FILE = settings.BASE_DIR / "examples" / "arith" / "preset.json"


@dataclass(frozen=True)
class Preset:
    slug: str
    title: str
    model: str
    harness: str
    """The name of the user's harness it runs (the demo's, or the template's slug)."""
    dataset: str
    reward_script: str
    config: dict[str, Any]
    notes: str = ""

    @property
    def tagged_config(self) -> dict[str, Any]:
        """The config a run of this preset is created with: `extra.preset` names the preset."""
        return tag(self.config, self.slug)


def tag(config: dict[str, Any], slug: str) -> dict[str, Any]:
    """`config` with `extra.preset` set to `slug` (other extra keys kept)."""
    return {**config, "extra": {**(config.get("extra") or {}), "preset": slug}}


def demo() -> Preset:
    raw = json.loads(DEMO_FILE.read_text())
    return Preset(DEMO_SLUG, "Arithmetic demo (examples/arith)", raw["model"], raw["harness"], raw["dataset"],
                  raw["reward_script"], raw["config"], raw.get("notes", ""))


def all_presets() -> list[Preset]:
    """The demo's preset first, then each harness template's, by slug."""
    found = [demo()]
    for template in harness_templates.templates():
        p = template.preset
        if p:
            found.append(Preset(template.slug, template.title, p["model"], template.slug, p["dataset"],
                                p["reward_script"], p["config"], p.get("notes", "")))
    return found


def find(slug: str) -> Preset | None:
    return next((p for p in all_presets() if p.slug == slug), None)


def last_run_signal(user, slug: str) -> dict[str, Any] | None:
    """The user's latest run of preset `slug` that trained a step: its id, name, steps, whether dynamic sampling
    was on, and the mean over its steps of the share of sampled groups with signal (and of trained groups). Two
    queries. None when no such run exists."""
    runs = Run.objects.filter(owner=user, config__extra__preset=slug, step__gt=0).order_by("-created_at", "-pk")
    run = runs.only("pk", "name", "step", "config").first()
    if run is None:
        return None
    rows = signal.step_figures(run)
    sampled = [r["sampled_signal_share"] for r in rows if r["sampled_signal_share"] is not None]
    trained = [r["signal_share"] for r in rows if r["signal_share"] is not None]
    return {"run": run.pk, "name": run.name, "steps": run.step,
            "dynamic_sampling": bool((run.config or {}).get("dynamic_sampling")),
            "sampled_signal_share": sum(sampled) / len(sampled) if sampled else None,
            "signal_share": sum(trained) / len(trained) if trained else None}
