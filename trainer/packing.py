"""Samples packed into rows for one forward pass, and a mini-batch split into micro-batches by padded size."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import torch
from torch import Tensor

from trainer.samples import Sample


@dataclass(frozen=True)
class PackedBatch:
    """Samples packed into rows; attention stays within a sample because its position ids restart at 0.

    Rows are as long as the longest sample, so attention cost per token stays bounded by that length (one row
    of all the samples would make every token attend over the whole micro-batch).
    """

    input_ids: Tensor  # (R, L)
    position_ids: Tensor  # (R, L)
    logit_rows: Tensor  # (M,) row of the logit that predicts each loss token
    logit_cols: Tensor  # (M,) its column
    targets: Tensor  # (M,) the loss tokens, in sample order
    behaviour: Tensor  # (M,) engine logprobs of those tokens
    sample_index: Tensor  # (M,) index of each loss token's sample in the list given to `pack` (+ first_index)
    num_tokens: int  # real (non-padding) tokens

    def to(self, device: torch.device) -> "PackedBatch":
        if self.input_ids.device == device:
            return self
        tensors = {f.name: getattr(self, f.name).to(device) for f in fields(self) if f.name != "num_tokens"}
        return PackedBatch(**tensors, num_tokens=self.num_tokens)


def loss_token_starts(samples: Sequence[Sample]) -> list[int]:
    """(S + 1) offsets of each sample's first loss token in `pack`'s sample-ordered loss tokens."""
    starts = [0]
    for s in samples:
        starts.append(starts[-1] + sum(s.loss_mask[1:]))
    return starts


def layout(lengths: Sequence[int]) -> list[list[int]]:
    """The rows `pack` makes: first-fit-decreasing of whole samples into rows as wide as the longest one.

    Returns the sample indices placed in each row, in placement order (offsets follow from the lengths).
    """
    width = max(lengths)
    rows: list[list[int]] = []
    used: list[int] = []
    for k in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        r = next((i for i, u in enumerate(used) if u + lengths[k] <= width), len(rows))
        if r == len(rows):
            rows.append([])
            used.append(0)
        rows[r].append(k)
        used[r] += lengths[k]
    return rows


def padded_positions(lengths: Sequence[int]) -> int:
    """Rows x width of the batch `pack` makes of samples of these lengths: what a micro-batch costs."""
    return len(layout(lengths)) * max(lengths)


def pack(samples: Sequence[Sample], first_index: int = 0) -> PackedBatch:
    """First-fit-decreasing packing of whole samples into rows; loss tokens are listed in sample order."""
    lengths = [len(s.token_ids) for s in samples]
    width = max(lengths)
    placement: dict[int, tuple[int, int]] = {}  # sample -> (row, offset)
    positions: list[list[int]] = []
    for r, row in enumerate(layout(lengths)):
        positions.append([])
        for k in row:
            placement[k] = (r, len(positions[r]))
            positions[r].extend(range(lengths[k]))
        positions[r].extend(range(width - len(positions[r])))  # padding is a segment of its own
    ids = torch.zeros(len(positions), width, dtype=torch.long)  # (R, L) padding is token 0
    rows_, cols, targets, behaviour, owner = [], [], [], [], []
    for k, sample in enumerate(samples):
        r, offset = placement[k]
        ids[r, offset:offset + len(sample.token_ids)] = torch.tensor(sample.token_ids)
        for t, (m, lp) in enumerate(zip(sample.loss_mask, sample.logprobs)):
            if m and t > 0:  # the first token has no context to be predicted from
                rows_.append(r)
                cols.append(offset + t - 1)
                targets.append(sample.token_ids[t])
                behaviour.append(lp)
                owner.append(first_index + k)
    long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    return PackedBatch(ids, torch.tensor(positions), long(rows_), long(cols), long(targets),
                       torch.tensor(behaviour, dtype=torch.float32), long(owner), sum(lengths))


def micro_batches(samples: Sequence[Sample], budget: int) -> list[list[int]]:
    """Greedy contiguous split into index lists whose `pack` is at most `budget` padded positions (rows x width).

    A sample longer than the budget goes alone. Contiguous, so loss weights over the mini-batch slice in order.
    """
    batches: list[list[int]] = []
    lengths: list[int] = []
    for i, sample in enumerate(samples):
        n = len(sample.token_ids)
        if batches and padded_positions(lengths + [n]) <= budget:
            batches[-1].append(i)
            lengths.append(n)
        else:
            batches.append([i])
            lengths = [n]
    return batches
