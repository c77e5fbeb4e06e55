"""Ready-made harnesses: the templates in examples/harnesses/ (Codex CLI, Claude Code, OpenCode, mini-SWE-agent,
OpenHands), offered to every user.

A template is a `<slug>.harness.json` file beside the runner script it starts (its format: examples/harnesses/README.md).
Its command, env and `read_only` may name `${python}` (the app's Python), `${here}` (the template's folder) and
`${tools}` (where scripts/install-harnesses puts the agents); they are filled when a user's harness is made from it,
so the harness row holds plain paths the executor runs as they are. `read_only` lists the folders the harness is
shown read-only inside its sandbox (sandbox.isolation): its runner's folder and the tools dir; the harness row keeps
them in resources["read_only"].
"""
from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction

from catalog.models import Harness
from trainer.config import ConfigError, TrainerConfig

TEMPLATES_DIR = Path(__file__).resolve().parent.parent / "examples" / "harnesses"
REQUIRED = ("slug", "title", "description", "tool", "api", "streaming", "command", "env", "timeout_s")
PRESET_KEYS = ("model", "dataset", "reward_script", "config")
_TOKEN = re.compile(r"\$\{(python|here|tools)\}")


class TemplateError(ValueError):
    """A template file that cannot be used as it is; the message names the file and the problem."""


@dataclass(frozen=True)
class Template:
    slug: str
    title: str
    description: str
    tool: str
    api: str
    streaming: bool
    path: Path
    raw: dict[str, Any]

    def fields(self) -> dict[str, Any]:
        """The Harness fields a user's copy gets: the template's command and env with ${...} filled."""
        values = {"python": sys.executable, "here": str(self.path.parent), "tools": str(tools_dir())}

        def fill(text: str) -> str:
            return _TOKEN.sub(lambda m: values[m.group(1)], text)

        return {"name": self.slug, "description": f"{self.title}: {self.description}",
                "command": [fill(arg) for arg in self.raw["command"]],
                "env": {key: fill(value) for key, value in self.raw["env"].items()},
                "resources": {"read_only": [os.path.normpath(fill(path)) for path in self.raw.get("read_only", [])]},
                "executor": "local", "timeout_s": int(self.raw["timeout_s"])}

    @property
    def example_task(self) -> dict[str, Any] | None:
        return self.raw.get("example_task")

    @property
    def preset(self) -> dict[str, Any] | None:
        """The run this template is tuned for, when it has one: {"model", "dataset", "reward_script", "notes",
        "config"} (a TrainerConfig as JSON): the context length, sampling and sizes that fit its model here."""
        return self.raw.get("preset")

    def installed_version(self) -> str | None:
        """The version scripts/install-harnesses recorded for this template's agent, or None when it is missing."""
        return installed_versions().get(self.tool)


def tools_dir() -> Path:
    return Path(settings.LIGHTNING_HARNESS_TOOLS_DIR)


def installed_versions() -> dict[str, str]:
    """{tool: version} from the tools folder's versions.json ({} when nothing was installed)."""
    try:
        data = json.loads((tools_dir() / "versions.json").read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def _read(path: Path) -> Template:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise TemplateError(f"{path}: {exc}") from exc
    missing = [key for key in REQUIRED if key not in raw]
    if missing:
        raise TemplateError(f"{path}: missing {', '.join(missing)}")
    if not (isinstance(raw["command"], list) and all(isinstance(a, str) for a in raw["command"]) and raw["command"]):
        raise TemplateError(f"{path}: command must be a non-empty list of strings")
    if not (isinstance(raw["env"], dict) and all(isinstance(v, str) for v in raw["env"].values())):
        raise TemplateError(f"{path}: env must map names to strings")
    if not (isinstance(raw.get("read_only", []), list) and all(isinstance(p, str) for p in raw.get("read_only", []))):
        raise TemplateError(f"{path}: read_only must be a list of paths")
    _check_preset(path, raw.get("preset"))
    return Template(raw["slug"], raw["title"], raw["description"], raw["tool"], raw["api"], bool(raw["streaming"]),
                    path.resolve(), raw)


def _check_preset(path: Path, preset: Any) -> None:
    if preset is None:
        return
    missing = [key for key in PRESET_KEYS if not isinstance((preset or {}).get(key) if isinstance(preset, dict)
                                                            else None, (str, dict))]
    if missing:
        raise TemplateError(f"{path}: preset needs {', '.join(missing)}")
    try:
        TrainerConfig.from_dict(preset["config"])
    except ConfigError as exc:
        raise TemplateError(f"{path}: preset config: {exc}") from exc


@cache
def templates() -> tuple[Template, ...]:
    """Every template, ordered by slug; two templates with one slug are an error."""
    found = sorted((_read(p) for p in TEMPLATES_DIR.glob("*/*.harness.json")), key=lambda t: t.slug)
    slugs = [t.slug for t in found]
    if len(set(slugs)) != len(slugs):
        raise TemplateError(f"duplicate template slugs in {TEMPLATES_DIR}: {slugs}")
    return tuple(found)


def load(slug: str) -> Template:
    for template in templates():
        if template.slug == slug:
            return template
    raise KeyError(f"no harness template {slug!r} (have: {', '.join(t.slug for t in templates())})")


def add_for(user, slug: str) -> Harness:
    """The user's harness made from template `slug` (common_errors.ServiceError when a harness has that name)."""
    from catalog import services as catalog_services
    from common import errors as common_errors

    if Harness.objects.filter(owner=user, name=slug).exists():
        raise common_errors.ServiceError(f"you already have a harness named {slug!r}: rename it to add the template again")
    return catalog_services.create_harness(user, **load(slug).fields())


def ensure_for(user) -> list[Harness]:
    """Every template as one of the user's harnesses, made where missing (kept as they are where present)."""
    from catalog import services as catalog_services

    made = []
    with transaction.atomic():
        have = set(Harness.objects.filter(owner=user).values_list("name", flat=True))
        for template in templates():
            if template.slug not in have:
                made.append(catalog_services.create_harness(user, **template.fields()))
    return made
