"""The conformance table: one row per harness and mode, kept in test-output/conformance.json, shown as Markdown."""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from catalog import harness_templates
from runs.harness_check import CheckResult
from trainer.samples import DRIFT_CLASSES

OUTPUT = Path(__file__).resolve().parents[2] / "test-output" / "conformance.json"
COLUMNS = ("Harness", "Version", "API", "Streaming", "Calls", "Drift classes", "Trained / engine tokens")


@dataclass(frozen=True)
class Row:
    harness: str
    version: str
    api: str
    streaming: bool
    calls: int
    drift: dict[str, int]
    """Calls per drift class (clean, realign, fork)."""
    trained_tokens: int
    engine_tokens: int

    def cells(self) -> tuple[str, ...]:
        drift = ", ".join(f"{kind} {self.drift[kind]}" for kind in DRIFT_CLASSES if self.drift.get(kind))
        return (self.harness, self.version, self.api, "yes" if self.streaming else "no", str(self.calls),
                drift or "none", f"{self.trained_tokens} / {self.engine_tokens}")


def row_for(slug: str, result: CheckResult) -> Row:
    """The row of template `slug` from its check: the installed version, the template's API, the measured rest."""
    template = harness_templates.load(slug)
    return Row(slug, template.installed_version() or "not installed", template.api, template.streaming,
               len(result.calls), dict(Counter(result.build.drift.values())), result.trained_tokens,
               result.engine_tokens)


def record(row: Row, path: Path = OUTPUT) -> None:
    """Write the row into the JSON file, replacing an earlier row of the same harness (other rows stay)."""
    rows = {r.harness: r for r in load(path)}
    rows[row.harness] = row
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([asdict(r) for r in sorted(rows.values(), key=lambda r: r.harness)], indent=1) + "\n")


def load(path: Path = OUTPUT) -> list[Row]:
    if not path.is_file():
        return []
    names = {f.name for f in fields(Row)}
    return [Row(**{k: v for k, v in item.items() if k in names}) for item in json.loads(path.read_text())]


def markdown(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row.cells()) + " |" for row in rows]
    return "\n".join(lines)
