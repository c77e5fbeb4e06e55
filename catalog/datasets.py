"""Parsing and splitting uploaded task files (JSONL or a JSON array), every bad line reported; reward-only fields.

A JSONL export of a run's rollouts (dashboard/export.py, docs/export-schema.md) is recognised by the schema id its
lines carry and loads as a dataset of recorded trajectories: one task per rollout.
"""
from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

SPLITS = ("train", "val")
MAX_ERRORS = 200
# Reward-only task fields every dataset hides from its harness. A dataset's own `hidden_fields` extend this set;
# they never replace it, so forgetting to list `answer` cannot leak it. Names are top-level keys of a task.
DEFAULT_HIDDEN_FIELDS = ("answer", "expected", "solution", "tests")
EXPORT_SCHEMA = "lightning-web/rollout-export"
"""The `schema` of every line of a rollouts export (dashboard/export.py); here so that parsing needs no models."""
EXPORT_VERSIONS = (1,)


def hidden_fields(extra: Iterable[str] = ()) -> list[str]:
    """The reward-only fields of a dataset: the defaults and its own, sorted."""
    return sorted(set(DEFAULT_HIDDEN_FIELDS) | set(extra))


def harness_view(task: dict[str, Any], hidden: Iterable[str]) -> dict[str, Any]:
    """The task as the harness may see it: every hidden top-level field left out. The reward gets the full task."""
    hidden = set(hidden)
    return {key: value for key, value in task.items() if key not in hidden}


def field_names(value: Any) -> list[str]:
    """Field names given as a list, a JSON list in a string, or a comma-separated string; ValueError says why not."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith(("[", "{")):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not a valid JSON list: {exc.msg} at column {exc.colno}") from None
        else:
            value = [name.strip() for name in text.split(",")] if text else []
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"must be a list of field names, got {_type_name(value)}")
    names = []
    for name in value:
        if not isinstance(name, str) or not name.strip():
            shown = json.dumps(name, default=repr)[:50]
            raise ValueError(f"every field name must be a non-empty string, got {shown}")
        if len(name) > 200:
            raise ValueError(f"field name {name[:20]!r}... is longer than 200 characters")
        if name.strip() not in names:
            names.append(name.strip())
    return names


@dataclass(frozen=True)
class ParsedTask:
    line: int
    external_id: str
    split: str
    data: dict[str, Any]


@dataclass
class ParseResult:
    tasks: list[ParsedTask] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)

    def error(self, line: int, message: str) -> None:
        if len(self.errors) < MAX_ERRORS:
            self.errors.append({"line": line, "error": message})


SEED_MIN, SEED_MAX = -(2 ** 31), 2 ** 31 - 1
"""The seeds a dataset row can hold (a 32-bit integer column)."""

@dataclass(frozen=True)
class UploadOptions:
    split_field: str = ""
    val_ratio: float = 0.0
    seed: int = 0
    required_fields: tuple[str, ...] = ()
    max_line_bytes: int = 1024 * 1024


def parse_tasks(content: bytes, filename: str, options: UploadOptions) -> ParseResult:
    """Parse, validate and split; the result holds either tasks or errors (never a partial set)."""
    result = ParseResult()
    try:
        text = content.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = content[: exc.start].count(b"\n") + 1
        result.error(line, f"not valid UTF-8 ({exc.reason} at byte {exc.start})")
        return result
    if not text.strip():
        result.error(1, "the file is empty: expected one JSON object per line (JSONL) or a JSON array")
        return result
    if _is_export(text):
        return _parse_export(_jsonl_items(text, options, result), result)
    items = _json_array_items(text, result) if _is_json_array(text, filename) else _jsonl_items(text, options, result)
    seen: dict[str, int] = {}
    raw: list[tuple[int, dict[str, Any], str, str | None]] = []
    for line, obj in items:
        checked = _check_task(line, obj, options, seen, result)
        if checked is not None:
            raw.append(checked)
    if not raw and not result.errors:
        result.error(1, "the file holds no tasks")
    if result.errors:
        return result
    result.tasks = _assign_splits(raw, options)
    return result


def _is_export(text: str) -> bool:
    """Whether the first line is a rollouts export record (its other lines are then held to the same)."""
    first = text.lstrip().split("\n", 1)[0]
    if EXPORT_SCHEMA not in first:
        return False
    try:
        record = json.loads(first)
    except json.JSONDecodeError:
        return False
    return isinstance(record, dict) and record.get("schema") == EXPORT_SCHEMA


def _parse_export(items, result: ParseResult) -> ParseResult:
    """One task per exported rollout: id `rollout-<id>`, the rollout's split, the whole record as its data.

    Split options (split_field, val_ratio) do not apply: a recorded trajectory keeps the split it ran in.
    """
    seen: dict[str, int] = {}
    tasks = []
    for line, record in items:
        message = export_record_error(record)
        if message:
            result.error(line, message)
            continue
        external_id = f"rollout-{record['rollout']['id']}"
        if external_id in seen:
            result.error(line, f"rollout {record['rollout']['id']} appears twice (first on line {seen[external_id]})")
            continue
        seen[external_id] = line
        tasks.append(ParsedTask(line=line, external_id=external_id, split=record["rollout"]["split"], data=record))
    if not tasks and not result.errors:
        result.error(1, "the export holds no rollouts")
    if not result.errors:
        result.tasks = tasks
    return result


def export_record_error(record: Any) -> str:
    """Why `record` is not a line of a rollouts export this version reads; '' when it is."""
    if not isinstance(record, dict) or record.get("schema") != EXPORT_SCHEMA:
        return f"not a rollouts export record (expected \"schema\": \"{EXPORT_SCHEMA}\" as on the first line)"
    if record.get("version") not in EXPORT_VERSIONS:
        return f"export version {json.dumps(record.get('version'))[:20]} is not one of {list(EXPORT_VERSIONS)}"
    rollout = record.get("rollout")
    if not isinstance(rollout, dict) or isinstance(rollout.get("id"), bool) or not isinstance(rollout.get("id"), int):
        return "field 'rollout' must be an object with an integer 'id'"
    if rollout.get("split") not in SPLITS:
        return f"rollout.split must be one of {list(SPLITS)}, got {json.dumps(rollout.get('split'))[:50]}"
    for name in ("calls", "samples"):
        if not isinstance(record.get(name), list):
            return f"field '{name}' must be an array"
    return ""


def _is_json_array(text: str, filename: str) -> bool:
    return text.lstrip().startswith("[") or filename.lower().endswith(".json")


def _jsonl_items(text: str, options: UploadOptions, result: ParseResult):
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        size = len(line.encode("utf-8"))
        if size > options.max_line_bytes:
            result.error(number, f"line is {size} bytes, over the limit of {options.max_line_bytes} bytes")
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as exc:
            result.error(number, f"invalid JSON: {exc.msg} at column {exc.colno}")


def _json_array_items(text: str, result: ParseResult):
    """Yield (line, value) per array element, with the line where each element starts."""
    decoder = json.JSONDecoder()
    pos = _skip_ws(text, 0)
    if pos >= len(text) or text[pos] != "[":
        result.error(_line_of(text, pos), "a .json file must hold a JSON array of task objects")
        return
    pos = _skip_ws(text, pos + 1)
    if pos < len(text) and text[pos] == "]":
        return
    while pos < len(text):
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            result.error(exc.lineno, f"invalid JSON: {exc.msg} at column {exc.colno}")
            return
        yield _line_of(text, pos), value
        pos = _skip_ws(text, end)
        if pos < len(text) and text[pos] == ",":
            pos = _skip_ws(text, pos + 1)
        elif pos < len(text) and text[pos] == "]":
            if text[pos + 1:].strip():
                result.error(_line_of(text, pos + 1), "unexpected content after the closing ']'")
            return
        else:
            result.error(_line_of(text, pos), "expected ',' or ']' between array elements")
            return
    result.error(_line_of(text, len(text)), "the JSON array is not closed with ']'")


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _check_task(line, obj, options, seen, result):
    if not isinstance(obj, dict):
        result.error(line, f"expected a JSON object, got {_type_name(obj)}")
        return None
    for name in options.required_fields:
        if name not in obj:
            result.error(line, f"missing required field '{name}'")
            return None
    external_id = obj.get("id", None)
    if external_id is not None:
        if isinstance(external_id, bool) or not isinstance(external_id, (str, int)):
            result.error(line, f"field 'id' must be a string or an integer, got {_type_name(external_id)}")
            return None
        external_id = str(external_id)
        if not external_id or len(external_id) > 200:
            result.error(line, "field 'id' must be 1 to 200 characters long")
            return None
        if external_id in seen:
            result.error(line, f"duplicate id '{external_id}' (first seen on line {seen[external_id]})")
            return None
        seen[external_id] = line
    split_key = options.split_field or "split"
    split = obj.get(split_key)
    if options.split_field and split_key not in obj:
        result.error(line, f"missing split field '{split_key}'")
        return None
    if split is not None and split not in SPLITS:
        result.error(line, f"field '{split_key}' must be one of {list(SPLITS)}, got {json.dumps(split)[:50]}")
        return None
    return line, obj, external_id, split


def _assign_splits(raw, options: UploadOptions) -> list[ParsedTask]:
    """Explicit splits win; the rest go to val by a seeded draw at val_ratio."""
    rng = random.Random(options.seed)
    taken = {ext for _, _, ext, _ in raw if ext is not None}
    tasks = []
    for index, (line, obj, external_id, split) in enumerate(raw):
        if external_id is None:
            external_id = str(index)
            while external_id in taken:
                external_id = f"{external_id}_"
            taken.add(external_id)
        draw = rng.random()  # drawn for every task so a split is stable whatever the explicit ones are
        if split is None:
            split = "val" if draw < options.val_ratio else "train"
        tasks.append(ParsedTask(line=line, external_id=external_id, split=split, data=obj))
    return tasks


def _type_name(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)
