"""Training samples from one rollout's recorded calls: clean appends, realigned splices, forks."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

CLEAN, REALIGN, FORK = "clean", "realign", "fork"
POLICY_FAILURE, INFRA_FAILURE = "policy", "infra"
"""A failed rollout's kind: the policy's (trained with failure_reward) or the infrastructure's (left out)."""
DRIFT_CLASSES = (CLEAN, REALIGN, FORK)

Decode = Callable[[Sequence[int]], str]
"""Token ids -> text (e.g. ``tokenizer.decode``); needed to prove that two token runs spell the same text."""


@dataclass(frozen=True)
class CallRecord:
    """One recorded model call as the trainer sees it: the engine's exact ids and sampled-token logprobs."""

    seq: int
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str = "stop"
    policy_version: int = 0
    constrained: bool = False
    """The engine decoded it under a grammar or schema (proxy.sampling.constraint_of): its tokens were forced,
    not sampled from the policy, so they join the sample as context (loss mask 0), never as trained tokens."""
    choice: int = 0
    """Which choice of a call that asked for n > 1 this is (proxy.recording.per_choice): choice k of the call
    recorded at seq s has seq s + k. See build_samples for which choices are trained."""

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError(f"call {self.seq}: {len(self.logprobs)} logprobs for "
                             f"{len(self.completion_ids)} completion ids")


@dataclass(frozen=True)
class Span:
    """Tokens [start, end) of a sample came from call `call_seq`, as its prompt or its sampled completion."""

    call_seq: int
    start: int
    end: int
    sampled: bool


@dataclass(frozen=True)
class Sample:
    """One training sequence. loss_mask is 1 exactly on tokens the engine sampled (proven origin)."""

    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    """Behaviour logprob of each token (0.0 where loss_mask is 0)."""
    versions: tuple[int, ...]
    """Policy version that sampled each token (-1 where loss_mask is 0)."""
    spans: tuple[Span, ...]
    call_seqs: tuple[int, ...]
    build: str
    """'single' (one call), 'merged' (clean appends) or 'realigned' (at least one realign splice)."""

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def min_version(self) -> int:
        """Oldest policy version among the sampled tokens (staleness is measured against it)."""
        sampled = [v for v, m in zip(self.versions, self.loss_mask) if m]
        return min(sampled) if sampled else -1


@dataclass(frozen=True)
class BuildResult:
    samples: tuple[Sample, ...]
    drift: dict[int, str] = field(default_factory=dict)
    """Drift class of every call by its seq: 'clean', 'realign' or 'fork' (a rollout's first call is 'clean')."""


@dataclass
class _Builder:
    """A sample under construction; `tokens` is the exact sequence a following call must extend."""

    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    call_seqs: list[int] = field(default_factory=list)
    realigned: bool = False

    def add(self, call_seq: int, ids: Sequence[int], sampled: bool, logprobs: Sequence[float] = (),
            version: int = -1) -> None:
        if not ids:
            return
        start = len(self.tokens)
        self.tokens.extend(ids)
        self.mask.extend([int(sampled)] * len(ids))
        self.logprobs.extend(logprobs if sampled else [0.0] * len(ids))
        self.versions.extend([version if sampled else -1] * len(ids))
        self.spans.append(Span(call_seq, start, len(self.tokens), sampled))

    def add_call(self, call: CallRecord, context: Sequence[int]) -> None:
        """Append a call: `context` (the prompt tail not yet in the sample) unweighted, then its completion."""
        self.add(call.seq, context, sampled=False)
        self.add(call.seq, call.completion_ids, not call.constrained, call.logprobs, call.policy_version)
        self.call_seqs.append(call.seq)

    def unweight(self, call_seqs: set[int]) -> None:
        """Take the completions of `call_seqs` out of the loss (they stay as context)."""
        spans = []
        for span in self.spans:
            if span.sampled and span.call_seq in call_seqs:
                for i in range(span.start, span.end):
                    self.mask[i], self.logprobs[i], self.versions[i] = 0, 0.0, -1
                span = Span(span.call_seq, span.start, span.end, False)
            spans.append(span)
        self.spans = spans

    def freeze(self) -> Sample:
        build = "realigned" if self.realigned else ("merged" if len(self.call_seqs) > 1 else "single")
        return Sample(tuple(self.tokens), tuple(self.mask), tuple(self.logprobs), tuple(self.versions),
                      tuple(self.spans), tuple(self.call_seqs), build)


def build_samples(calls: Iterable[CallRecord], decode: Decode | None = None) -> BuildResult:
    """Merge a rollout's calls (in seq order) into samples; every call extends, realigns onto, or forks a sample.

    A call is matched against every sample built so far (a sub-agent may interleave with its parent), newest
    first. Without `decode` nothing can be proven about text, so token mismatches always fork.

    The choices of a call that asked for n > 1 (CallRecord.choice) are trained by this rule: when a later call
    continues some of them (extends or realigns onto the sample that ends with one), only those are trained and
    the others, which the harness discarded, stay in their samples as context only; when no later call continues
    any (the rollout's last call, or a harness that combines its choices, as a vote does), the outcome may rest on
    any or all of them, and all are trained with the rollout's advantage.
    """
    ordered = sorted(calls, key=lambda c: c.seq)
    builders: list[_Builder] = []
    drift: dict[int, str] = {}
    continued: set[int] = set()  # seqs of calls whose sample a later call extended or realigned onto
    for call in ordered:
        if not call.prompt_ids and not call.completion_ids:  # failed before any token: nothing to build on
            drift[call.seq] = FORK
            continue
        kind, builder, context = _classify(call, builders, decode)
        if builder is None:
            builder = _Builder()
            builders.append(builder)
        elif builder.call_seqs:
            continued.add(builder.call_seqs[-1])
        builder.realigned |= kind == REALIGN
        builder.add_call(call, context)
        drift[call.seq] = CLEAN if len(builders) == 1 and len(builder.call_seqs) == 1 else kind
    discarded = _discarded_choices(ordered, continued)
    if discarded:
        for builder in builders:
            builder.unweight(discarded)
    samples = tuple(b.freeze() for b in builders if any(b.mask))
    return BuildResult(samples, drift)


def _discarded_choices(calls: Sequence[CallRecord], continued: set[int]) -> set[int]:
    """Seqs of the choices of n > 1 calls that the harness discarded: siblings of a continued choice (see
    build_samples) that no later call continued."""
    siblings: dict[int, list[int]] = {}  # the call's first seq -> the seqs of its choices
    for call in calls:
        siblings.setdefault(call.seq - call.choice, []).append(call.seq)
    discarded: set[int] = set()
    for seqs in siblings.values():
        if len(seqs) > 1 and continued.intersection(seqs):
            discarded.update(s for s in seqs if s not in continued)
    return discarded


def _classify(call: CallRecord, builders: list[_Builder], decode: Decode | None
              ) -> tuple[str, _Builder | None, Sequence[int]]:
    """Return (drift class, builder to extend or None for a new sample, prompt tail to append unweighted)."""
    prompt = call.prompt_ids
    # Longest sample first: when a sample is a prefix of another, the longer one holds more proven context.
    for builder in sorted(reversed(builders), key=lambda b: -len(b.tokens)):
        n = len(builder.tokens)
        if n <= len(prompt) and tuple(builder.tokens) == tuple(prompt[:n]):
            return CLEAN, builder, prompt[n:]
    if decode is not None:
        for builder in reversed(builders):
            cut = realign_cut(builder.tokens, prompt, decode)
            if cut is not None:
                return REALIGN, builder, prompt[cut:]
    return FORK, None, prompt


TAIL_MARGIN = 8
"""Shared tokens a realign's tails keep before the first differing token: a decoder may treat a text's first
tokens apart (SentencePiece drops a leading space; a byte-level token may hold half a character), so both tails
begin on tokens the two sequences share and such an effect falls on both alike."""


def realign_cut(tokens: Sequence[int], prompt: Sequence[int], decode: Decode) -> int | None:
    """Smallest k with decode(prompt[:k]) == decode(tokens), or None when no prompt prefix spells that text.

    That equality is the proof that `tokens` (holding the originally sampled ids) and prompt[:k] are the same
    text, so the sample may keep `tokens` and continue with prompt[k:]. The candidate cuts are searched on the
    tails past the common prefix (an agent's context is long and its realigned tail short: decoding the whole
    context for every candidate was quadratic); the cut found is then proven once on the whole texts.
    """
    common = _common_prefix(tokens, prompt)
    if common == len(tokens):
        return None  # a clean extension (or the prompt is shorter): not a realign
    start = max(0, common - TAIL_MARGIN)
    target = decode(tokens[start:])
    for k in range(common + 1, len(prompt) + 1):
        text = decode(prompt[start:k])
        if text == target and decode(prompt[:k]) == decode(tokens):
            return k
        if not target.startswith(text[:-4]):
            return None  # diverged (the last few characters may still be a partial multi-byte character)
    return None


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def drop_reason(failure_kind: str, error: str) -> str:
    """Why a rollout gave its step no trained sample: 'infra_failure[: <error>]' (left out of the loss and the
    baseline) or 'no_sampled_tokens' (no call of it returned a sampled token). Torch-free, so the web pages that
    explain old runs' steps share it with the scheduler."""
    if failure_kind == INFRA_FAILURE:
        return f"infra_failure: {error}" if error else "infra_failure"
    return "no_sampled_tokens"
