"""Reads for the token view of one training sample: its owned row, token chunks, call spans and their drift."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from django.db.models import QuerySet

from catalog import selectors, tokenizers
from runs.models import ModelCall, Sample
from trainer.samples import CallRecord, build_samples

logger = logging.getLogger(__name__)

MAX_CHUNK = 8192
"""Most tokens one JSON chunk carries."""

SAMPLE_FIELDS = (
    "id", "index", "token_ids", "loss_mask", "logprobs", "trainer_logprobs", "advantage", "call_seqs", "spans",
    "step", "build", "policy_version", "rollout_id", "rollout__id", "rollout__step", "rollout__group",
    "rollout__attempt", "rollout__split", "rollout__reward", "rollout__status", "rollout__trained_step",
    "rollout__task__id", "rollout__task__external_id", "rollout__run__id", "rollout__run__name",
    "rollout__run__model_info", "rollout__run__owner_id",
)
"""What the page reads: the sample's own columns and a few facts of its rollout, task and run (no call blobs,
no snapshots, no output tails)."""


def owned_samples(user) -> QuerySet:
    """Samples the user may see, with their rollout, task and run in the same query."""
    rows = Sample.objects.select_related("rollout__run", "rollout__task").only(*SAMPLE_FIELDS)
    return selectors.owned(rows, user)


def tokenizer_for(sample: Sample) -> tokenizers.Loaded:
    return tokenizers.load_tokenizer(str((sample.rollout.run.model_info or {}).get("path") or ""))


def texts_for(sample: Sample, loaded: tokenizers.Loaded, end: int | None = None) -> list[str] | None:
    """Display text of the sample's tokens; with `end`, of the first `end` only (the page's first chunk).

    The whole sample is decoded once per process and cached; a prefix is decoded a few tokens long so a
    character split over tokens is whole in it (UTF-8 takes at most 4 bytes, each token at least one).
    """
    if loaded.tokenizer is None:
        return None
    ids = sample.token_ids
    if end is not None and end + 4 < len(ids):
        return tokenizers.token_texts(loaded.tokenizer, ids[:end + 4])[:end]
    return tokenizers.cached_token_texts(loaded, ("sample", sample.pk), ids)


def chunk(sample: Sample, texts: list[str] | None, start: int, count: int) -> list[dict[str, Any]]:
    """Tokens [start, start + count): id, text (None without a tokenizer), loss mask, behaviour logprob (loss
    tokens only: context tokens carry none), trainer logprob and |trainer - behaviour| where recorded."""
    ids, mask, lps = sample.token_ids, sample.loss_mask, sample.logprobs
    tlps = sample.trainer_logprobs or []
    rows = []
    for i in range(start, min(start + count, len(ids))):
        trained = int(mask[i]) if i < len(mask) else 0
        lp = float(lps[i]) if trained and i < len(lps) else None
        tlp = tlps[i] if i < len(tlps) else None
        rows.append({"i": i, "id": ids[i], "text": texts[i] if texts is not None else None, "mask": trained,
                     "lp": lp, "tlp": tlp,
                     "mismatch": abs(tlp - lp) if tlp is not None and lp is not None else None})
    return rows


def stats(sample: Sample) -> dict[str, Any]:
    """Token counts and, where the trainer's logprobs were recorded, the mismatch over the loss tokens."""
    mask, lps, tlps = sample.loss_mask, sample.logprobs, sample.trainer_logprobs or []
    trained = sum(1 for m in mask if m)
    gaps = [abs(tlps[i] - lps[i]) for i, m in enumerate(mask)
            if m and i < len(tlps) and i < len(lps) and tlps[i] is not None]
    sampled = [lps[i] for i, m in enumerate(mask) if m and i < len(lps)]
    return {"total": len(sample.token_ids), "trained": trained, "context": len(sample.token_ids) - trained,
            "mean_logprob": sum(sampled) / len(sampled) if sampled else None,
            "trainer_recorded": bool(gaps),
            "mean_mismatch": sum(gaps) / len(gaps) if gaps else None, "max_mismatch": max(gaps) if gaps else None,
            "perplexity": math.exp(-sum(sampled) / len(sampled)) if sampled else None}


@dataclass(frozen=True)
class CallSpans:
    """The sample's spans ([call_seq, start, end, sampled]) and its calls' facts; `note` when spans are unknown."""

    spans: list[list]
    calls: list[dict[str, Any]]
    recomputed: bool = False
    note: str = ""


CALL_FACTS = ("seq", "api", "drift", "policy_version", "finish_reason", "latency_ms", "constraint", "choice")


def call_spans(sample: Sample, loaded: tokenizers.Loaded) -> CallSpans:
    """The recorded spans, or for a sample recorded before spans were, the spans rebuilt from the rollout's calls.

    One query for the calls' facts; an old sample also reads its rollout's token columns (never the request or
    response bodies) and rebuilds its samples with trainer.samples.build_samples, as the trainer did.
    """
    seqs = set(sample.call_seqs or [])
    if sample.spans:
        calls = list(ModelCall.objects.filter(rollout_id=sample.rollout_id, seq__in=seqs).order_by("seq")
                     .values(*CALL_FACTS))
        return CallSpans([list(span) for span in sample.spans], calls)
    rows = list(ModelCall.objects.filter(rollout_id=sample.rollout_id).order_by("seq")
                .values(*CALL_FACTS, "prompt_ids", "completion_ids", "logprobs"))
    calls = [{k: row[k] for k in CALL_FACTS} for row in rows if row["seq"] in seqs]
    spans = _rebuilt_spans(sample, rows, loaded)
    if spans is None:
        return CallSpans([], calls, note="This sample predates recorded spans and its calls no longer rebuild it: "
                                         "call boundaries unknown.")
    return CallSpans(spans, calls, recomputed=True)


def _rebuilt_spans(sample: Sample, rows: list[dict], loaded: tokenizers.Loaded) -> list[list] | None:
    records = []
    for row in rows:
        try:
            records.append(CallRecord(row["seq"], tuple(row["prompt_ids"] or ()), tuple(row["completion_ids"] or ()),
                                      tuple(row["logprobs"] or ()), policy_version=row["policy_version"],
                                      constrained=bool(row["constraint"]), choice=row["choice"]))
        except ValueError:  # a call whose logprobs do not cover its completion: the trainer skipped it too
            logger.warning("sample %s: call %s of rollout %s is not rebuildable", sample.pk, row["seq"],
                           sample.rollout_id, exc_info=True)
    decode = loaded.tokenizer.decode if loaded.tokenizer is not None else None
    built = build_samples(records, decode).samples
    wanted = tuple(sample.token_ids)
    candidates = ([built[sample.index]] if sample.index < len(built) else []) + list(built)
    for candidate in candidates:
        if candidate.token_ids == wanted:
            return [[s.call_seq, s.start, s.end, s.sampled] for s in candidate.spans]
    return None
