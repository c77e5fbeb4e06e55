"""The realign cut as main computed it before issue 40.7: the whole context decoded for every candidate cut.

Kept as the reference that trainer.samples.realign_cut must equal (tests/trainer/test_samples.py) and as the
"before" of bench/realign_cut.py; no production code imports it.
"""
from __future__ import annotations

from typing import Sequence

from trainer.samples import Decode


def reference_realign_cut(tokens: Sequence[int], prompt: Sequence[int], decode: Decode) -> int | None:
    """Smallest k with decode(prompt[:k]) == decode(tokens), scanning k past the common prefix; None when the
    texts diverge (beyond the last four characters, which may be a partial multi-byte character)."""
    common = 0
    for a, b in zip(tokens, prompt):
        if a != b:
            break
        common += 1
    if common == len(tokens):
        return None
    target = decode(tokens)
    for k in range(common + 1, len(prompt) + 1):
        text = decode(prompt[:k])
        if text == target:
            return k
        if not target.startswith(text[:-4]):
            return None
    return None
