"""A run's rollouts as JSONL (one rollout a line, its calls and samples inside), streamed in bounded memory; reading
an export back for offline use. The format is documented in docs/export-schema.md.

Memory stays bounded whatever the run's size: rollouts are read with a server-side cursor, their calls and samples
a batch of rollouts at a time (two queries a batch, CHUNK rows in flight), and the JSON columns are read as the
database's own text and spliced into the line, never parsed into Python objects.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import Any

from asgiref.sync import sync_to_async
from django.core.handlers.asgi import ASGIRequest
from django.db.models import TextField
from django.db.models.functions import Cast
from django.http import StreamingHttpResponse

from catalog.datasets import EXPORT_SCHEMA, EXPORT_VERSIONS, export_record_error
from dashboard import conversations
from dashboard.rollout_queries import RolloutQuery
from runs.models import ModelCall, Rollout, Run, Sample

EXPORT_VERSION = EXPORT_VERSIONS[-1]
CONTENT_TYPE = "application/jsonl; charset=utf-8"
BATCH = 200  # rollouts whose calls and samples are read together (two queries)
CHUNK = 50  # calls or samples fetched from the database at a time
WRITE_BYTES = 256 * 1024  # lines are sent in pieces of about this size

ROLLOUT_COLUMNS = ("id", "split", "step", "batch_step", "trained_step", "group", "attempt", "greedy",
                   "policy_version", "status", "reward", "reward_detail", "failure_kind", "drop_reason", "exit_code",
                   "error", "call_count", "created_at", "started_at", "finished_at", "task__external_id", "task__data")
CALL_COLUMNS = ("seq", "api", "stream", "status_code", "finish_reason", "latency_ms", "policy_version", "drift",
                "error", "replica", "retried")
CALL_JSON = ("request", "response", "prompt_ids", "completion_ids", "logprobs", "sampling_overrides")
SAMPLE_COLUMNS = ("index", "advantage", "build", "step", "policy_version")
SAMPLE_JSON = ("token_ids", "loss_mask", "logprobs", "trainer_logprobs", "call_seqs", "spans")


class RawJson(str):
    """JSON text as the database rendered it: written into a line as is."""


def export_lines(run: Run, query: RolloutQuery) -> Iterator[str]:
    """One JSON line (newline included) per rollout of `run` that the table's filters keep, in id order.

    The table's sort and page do not apply: an export holds every matching rollout.
    """
    header = _fields({"schema": EXPORT_SCHEMA, "version": EXPORT_VERSION,
                      "run": {"id": run.pk, "name": run.name, "model": run.model}})
    rollouts = (query.filter(Rollout.objects.filter(run=run), run).order_by("id")
                .values(*ROLLOUT_COLUMNS).iterator(chunk_size=BATCH))
    while batch := list(islice(rollouts, BATCH)):
        ids = [row["id"] for row in batch]
        calls = _Grouped(_json_rows(ModelCall.objects.filter(rollout_id__in=ids).order_by("rollout_id", "seq"),
                                    CALL_COLUMNS, CALL_JSON))
        samples = _Grouped(_json_rows(Sample.objects.filter(rollout_id__in=ids).order_by("rollout_id", "index"),
                                      SAMPLE_COLUMNS, SAMPLE_JSON))
        for row in batch:
            yield _line(header, run, row, calls.take(row["id"]), samples.take(row["id"]))


def _json_rows(rows, columns: tuple[str, ...], json_columns: tuple[str, ...]) -> Iterator[dict[str, Any]]:
    """Rows as dicts whose JSON columns are RawJson text (cast to text by the database), CHUNK at a time."""
    casts = {f"{name}_json": Cast(name, TextField()) for name in json_columns}
    for row in rows.annotate(**casts).values("rollout_id", *columns, *casts).iterator(chunk_size=CHUNK):
        for name in json_columns:
            text = row.pop(f"{name}_json")
            row[name] = RawJson(text if text is not None else "null")
        yield row


class _Grouped:
    """Rows ordered by rollout id, handed out one rollout's rows at a time (the rollouts are asked in id order)."""

    def __init__(self, rows: Iterator[dict[str, Any]]):
        self.rows = rows
        self.next = next(rows, None)

    def take(self, rollout_id: int) -> list[dict[str, Any]]:
        taken = []
        while self.next is not None and self.next["rollout_id"] <= rollout_id:
            row = self.next
            self.next = next(self.rows, None)
            if row.pop("rollout_id") == rollout_id:
                taken.append(row)
        return taken


def _line(header: str, run: Run, row: dict[str, Any], calls: list[dict], samples: list[dict]) -> str:
    started, finished = row["started_at"], row["finished_at"]
    task_data = row["task__data"]
    rollout = {
        **{name: row[name] for name in ("id", "split", "step", "batch_step", "trained_step", "group", "attempt",
                                        "greedy", "policy_version", "status", "reward", "reward_detail",
                                        "failure_kind", "drop_reason", "exit_code", "error", "call_count")},
        "timings": {"created_at": _iso(row["created_at"]), "started_at": _iso(started), "finished_at": _iso(finished),
                    "duration_s": (finished - started).total_seconds() if started and finished else None},
        "task_id": row["task__external_id"],
        "task": run.harness_task(task_data) if isinstance(task_data, dict) else None,
    }
    body = _fields({"rollout": rollout, "messages": _messages(calls),
                    "calls": RawJson(f"[{','.join(map(_fields, calls))}]"),
                    "samples": RawJson(f"[{','.join(map(_fields, samples))}]")})
    return f"{header[:-1]},{body[1:]}\n"


def _messages(calls: list[dict]) -> list[dict[str, Any]]:
    """The rollout's conversation as its last call saw it (the history it resent and its answer), in one shape for
    every API: only that call's request and response are parsed, so the line costs one parse, not one a call."""
    if not calls:
        return []
    last = calls[-1]
    conv = conversations.conversation(last["api"], json.loads(last["request"]), json.loads(last["response"]))
    return conversations.as_messages(conv)


def _fields(values: dict[str, Any]) -> str:
    """A JSON object of `values`, RawJson values written as they are."""
    return "{" + ",".join(f"{json.dumps(name)}:{value if isinstance(value, RawJson) else _dumps(value)}"
                          for name, value in values.items()) + "}"


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)


def _iso(moment) -> str | None:
    return moment.isoformat() if moment else None


# ---- the HTTP response (the run page's button and the API) --------------------------------------------------

def export_response(request, run: Run, query: RolloutQuery) -> StreamingHttpResponse:
    """The export as a download, streamed: synchronously under WSGI, through an async iterator under ASGI (Django
    would otherwise collect a synchronous iterator into one list before sending it)."""
    pieces = _pieces(export_lines(run, query))
    http_request = getattr(request, "_request", request)  # a DRF Request wraps Django's
    content = _async_pieces(pieces) if isinstance(http_request, ASGIRequest) else pieces
    response = StreamingHttpResponse(content, content_type=CONTENT_TYPE)
    response["Content-Disposition"] = f'attachment; filename="{filename(run)}"'
    response["X-Accel-Buffering"] = "no"  # a proxy in front must pass it on as it comes
    return response


def filename(run: Run) -> str:
    return f"run-{run.pk}-rollouts.jsonl"


def _pieces(lines: Iterable[str]) -> Iterator[bytes]:
    """Lines joined into pieces of about WRITE_BYTES (a long line goes alone)."""
    piece: list[bytes] = []
    size = 0
    for line in lines:
        data = line.encode()
        piece.append(data)
        size += len(data)
        if size >= WRITE_BYTES:
            yield b"".join(piece)
            piece, size = [], 0
    if piece:
        yield b"".join(piece)


async def _async_pieces(pieces: Iterator[bytes]) -> AsyncIterator[bytes]:
    """Each piece read in Django's sync thread (the database connection and its cursors live there)."""
    take = sync_to_async(lambda: next(pieces, None), thread_sensitive=True)
    try:
        while (piece := await take()) is not None:
            yield piece
    finally:  # a client that went away: close the cursors now, not when the generator is collected
        await sync_to_async(pieces.close, thread_sensitive=True)()


# ---- reading an export back ---------------------------------------------------------------------------------

def read_export(path: str | Path) -> Iterator[dict[str, Any]]:
    """The records of an export file, one dict per rollout, read a line at a time; ValueError names a bad line."""
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: invalid JSON: {exc.msg} at column {exc.colno}") from None
            message = export_record_error(record)
            if message:
                raise ValueError(f"{path}:{number}: {message}")
            yield record
