"""The token view of a training sample (/samples/<id>/tokens/) and the JSON chunks its script renders the rest from."""
from __future__ import annotations

from collections import Counter

from django.contrib.auth.decorators import login_required
from django.http import JsonResponse
from django.shortcuts import get_object_or_404, render
from django.urls import path, reverse
from django.views.decorators.http import require_GET

from dashboard import sample_tokens

FIRST_CHUNK = 2048
"""Tokens the page carries as data (rendered at once); the script fetches the rest in chunks of CHUNK."""
CHUNK = 4096


@login_required
@require_GET
def sample_tokens_page(request, sample_id: int):
    sample = get_object_or_404(sample_tokens.owned_samples(request.user), pk=sample_id)
    loaded = sample_tokens.tokenizer_for(sample)
    spans = sample_tokens.call_spans(sample, loaded)
    texts = sample_tokens.texts_for(sample, loaded, end=FIRST_CHUNK)
    stats = sample_tokens.stats(sample)
    rollout, run = sample.rollout, sample.rollout.run
    drift = {call["seq"]: call["drift"] for call in spans.calls}
    return render(request, "runs/sample_tokens.html", {
        "sample": sample, "rollout": rollout, "run": run, "stats": stats, "spans": spans, "loaded": loaded,
        "step": sample.step if sample.step is not None else rollout.trained_step,
        "drift_counts": sorted(Counter(d or "unclassified" for d in drift.values()).items()),
        "page_config": {
            "sample": sample.pk, "total": stats["total"], "chunk": CHUNK,
            "data_url": reverse("sample-tokens-data", args=[sample.pk]),
            "tokenizer": loaded.tokenizer is not None, "trainer": stats["trainer_recorded"],
            "spans": spans.spans, "drift": {str(seq): kind for seq, kind in drift.items()},
            "first": sample_tokens.chunk(sample, texts, 0, FIRST_CHUNK),
        },
    })


@login_required
@require_GET
def sample_tokens_data(request, sample_id: int):
    """Tokens [start, start + count) of the sample (count at most MAX_CHUNK): one query for the row."""
    try:
        start = int(request.GET.get("start", 0))
        count = int(request.GET.get("count", CHUNK))
    except ValueError:
        return JsonResponse({"error": "start and count must be whole numbers"}, status=400)
    if start < 0 or not 0 < count <= sample_tokens.MAX_CHUNK:
        return JsonResponse({"error": f"start must be >= 0 and count between 1 and {sample_tokens.MAX_CHUNK}"},
                            status=400)
    sample = get_object_or_404(sample_tokens.owned_samples(request.user), pk=sample_id)
    loaded = sample_tokens.tokenizer_for(sample)
    texts = sample_tokens.texts_for(sample, loaded)
    tokens = sample_tokens.chunk(sample, texts, start, count)
    return JsonResponse({"sample": sample.pk, "start": start, "count": len(tokens), "total": len(sample.token_ids),
                         "tokenizer": loaded.tokenizer is not None, "note": loaded.note, "tokens": tokens})


urlpatterns = [
    path("samples/<int:sample_id>/tokens/", sample_tokens_page, name="sample-tokens"),
    path("samples/<int:sample_id>/tokens.json", sample_tokens_data, name="sample-tokens-data"),
]
