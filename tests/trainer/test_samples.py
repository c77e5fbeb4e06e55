"""Samples from recorded calls: clean appends merge, forks split, realign never weights unproven tokens."""
from hypothesis import given, settings, strategies as st

import pytest

from tests.trainer.realign_reference import reference_realign_cut
from trainer.samples import CallRecord, build_samples, realign_cut

LETTERS = {i: chr(ord("a") + i) for i in range(26)}
BIGRAMS = {100: "ab", 101: "cd", 102: "ef"}
VOCAB = {**LETTERS, **BIGRAMS}
MERGE = {(0, 1): 100, (2, 3): 101, (4, 5): 102}


def decode(ids):
    return "".join(VOCAB[i] for i in ids)


def retokenize(ids):
    """The same text with letter pairs merged into bigram tokens, as a harness re-render might produce."""
    out, i = [], 0
    while i < len(ids):
        pair = tuple(ids[i:i + 2])
        if pair in MERGE:
            out.append(MERGE[pair])
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def call(seq, prompt, completion, version=0):
    return CallRecord(seq, tuple(prompt), tuple(completion), tuple(-0.1 * (seq + 1) - 0.01 * j
                                                                   for j in range(len(completion))),
                      policy_version=version)


tokens = st.lists(st.integers(0, 25), min_size=1, max_size=6)
turns = st.lists(st.tuples(tokens, tokens), min_size=1, max_size=5)


def conversation(system, turn_list, seq0=0, rerender=lambda ids: ids):
    """Calls of one append-only chat: prompt = history; history += completion + inserted tool/user tokens."""
    calls, history = [], list(system)
    for i, (completion, inserted) in enumerate(turn_list):
        calls.append(call(seq0 + i, history, completion))
        history = rerender(history + completion) + inserted
    return calls


def assert_every_weight_proven(result, calls):
    """Weighted tokens are exactly a call's sampled ids, and what precedes them spells that call's prompt."""
    by_seq = {c.seq: c for c in calls}
    for sample in result.samples:
        weighted = [0] * len(sample.token_ids)
        for span in sample.spans:
            if not span.sampled:
                continue
            c = by_seq[span.call_seq]
            assert sample.token_ids[span.start:span.end] == c.completion_ids
            assert sample.logprobs[span.start:span.end] == c.logprobs
            assert decode(sample.token_ids[:span.start]) == decode(c.prompt_ids)
            weighted[span.start:span.end] = [1] * (span.end - span.start)
        assert list(sample.loss_mask) == weighted


@settings(max_examples=60, deadline=None)
@given(system=tokens, turn_list=turns)
def test_it_merges_append_only_conversation_into_one_sample(system, turn_list):
    calls = conversation(system, turn_list)
    result = build_samples(calls)
    assert len(result.samples) == 1
    sample = result.samples[0]
    assert list(sample.token_ids) == list(calls[-1].prompt_ids) + list(calls[-1].completion_ids)
    weighted = [t for t, m in zip(sample.token_ids, sample.loss_mask) if m]
    assert weighted == [t for c in calls for t in c.completion_ids]
    assert [lp for lp, m in zip(sample.logprobs, sample.loss_mask) if m] == [lp for c in calls for lp in c.logprobs]
    assert set(result.drift.values()) == {"clean"}
    assert sample.call_seqs == tuple(range(len(calls)))
    assert sample.build == ("merged" if len(calls) > 1 else "single")
    assert_every_weight_proven(result, calls)


@settings(max_examples=60, deadline=None)
@given(main=turns, sub=turns, system=tokens)
def test_it_splits_interleaved_forks_into_their_own_samples(main, sub, system):
    main_calls = conversation([26 - 1] + system, main)  # 'z' opens the main agent's context
    sub_calls = conversation([24] + system, sub, seq0=len(main))  # 'y' opens the sub-agent's
    # Interleave: sub-agent calls happen after the first main call, the main agent then continues.
    order = [main_calls[0], *sub_calls, *main_calls[1:]]
    calls = [CallRecord(i, c.prompt_ids, c.completion_ids, c.logprobs) for i, c in enumerate(order)]
    result = build_samples(calls)
    assert len(result.samples) == 2
    main_sample, sub_sample = result.samples
    assert main_sample.call_seqs == (0, *range(1 + len(sub), len(calls)))
    assert sub_sample.call_seqs == tuple(range(1, 1 + len(sub)))
    assert result.drift[1] == "fork"
    assert [result.drift[s] for s in main_sample.call_seqs] == ["clean"] * len(main)
    assert_every_weight_proven(result, calls)


@settings(max_examples=60, deadline=None)
@given(system=tokens, turn_list=turns, with_decode=st.booleans())
def test_it_never_weights_unproven_tokens_when_history_is_retokenized(system, turn_list, with_decode):
    calls = conversation(system, turn_list, rerender=retokenize)
    result = build_samples(calls, decode=decode if with_decode else None)
    assert_every_weight_proven(result, calls)
    weighted = sum(s.num_loss_tokens for s in result.samples)
    assert weighted == sum(len(c.completion_ids) for c in calls)  # every call's completion is trained once
    if not with_decode:
        assert all(kind != "realign" for kind in result.drift.values())
    else:
        assert len(result.samples) == 1  # text always matches, so every retokenized call realigns
        assert result.samples[0].build in ("single", "merged", "realigned")


def test_it_masks_inserted_tool_tokens_in_a_hand_built_two_call_rollout():
    calls = [call(0, [7, 8], [1, 2]), call(1, [7, 8, 1, 2, 9, 9], [3], version=1)]
    sample, = build_samples(calls).samples
    assert sample.token_ids == (7, 8, 1, 2, 9, 9, 3)
    assert sample.loss_mask == (0, 0, 1, 1, 0, 0, 1)
    assert sample.logprobs == pytest.approx((0, 0, -0.1, -0.11, 0, 0, -0.2))
    assert sample.versions == (-1, -1, 0, 0, -1, -1, 1)
    assert sample.min_version == 0
    assert [(s.call_seq, s.start, s.end, s.sampled) for s in sample.spans] == [
        (0, 0, 2, False), (0, 2, 4, True), (1, 4, 6, False), (1, 6, 7, True)]


def test_it_splices_sampled_ids_back_when_the_next_prompt_spells_the_same_text():
    # The engine sampled 'a','b' (ids 0, 1); the harness re-rendered them as the bigram 'ab' (id 100).
    calls = [call(0, [25], [0, 1]), call(1, [25, 100, 7], [2])]
    result = build_samples(calls, decode=decode)
    sample, = result.samples
    assert result.drift == {0: "clean", 1: "realign"}
    assert sample.token_ids == (25, 0, 1, 7, 2)
    assert sample.loss_mask == (0, 1, 1, 0, 1)
    assert sample.build == "realigned"
    assert realign_cut([25, 0, 1], [25, 100, 7], decode) == 2
    assert realign_cut([25, 0, 1], [25, 101, 7], decode) is None


def test_it_forks_when_the_text_differs_and_drops_calls_without_completion():
    calls = [call(0, [], []), call(1, [25], [0, 1]), call(2, [25, 2, 3], []), call(3, [24], [5])]
    result = build_samples(calls, decode=decode)
    assert result.drift == {0: "fork", 1: "clean", 2: "fork", 3: "fork"}
    assert [s.token_ids for s in result.samples] == [(25, 0, 1), (24, 5)]


def test_it_rejects_logprobs_that_do_not_match_the_completion():
    with pytest.raises(ValueError, match="1 logprobs for 2 completion ids"):
        CallRecord(0, (1,), (2, 3), (-0.5,))


def test_it_realigns_a_chat_template_rerender_with_the_real_tiny_tokenizer():
    from trainer.models import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    render = lambda msgs: list(tok.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"])  # noqa: E731
    first = [{"role": "user", "content": "What is 12 times 34?"}]
    # The engine sampled a non-canonical split (one id per character); the template re-encodes it canonically.
    sampled = [i for ch in "CALC: 12*34" for i in tok.encode(ch, add_special_tokens=False)] + [2]
    second = first + [{"role": "assistant", "content": "CALC: 12*34"}, {"role": "user", "content": "RESULT: 408"}]
    calls = [call(0, render(first), sampled), call(1, render(second), [9, 2])]
    assert render(second)[:len(calls[0].prompt_ids) + len(sampled)] != list(calls[0].prompt_ids) + sampled

    def text(ids):
        return tok.decode(list(ids))

    result = build_samples(calls, decode=text)
    assert result.drift == {0: "clean", 1: "realign"}
    sample, = result.samples
    assert sample.token_ids[len(calls[0].prompt_ids):][:len(sampled)] == tuple(sampled)
    assert text(sample.token_ids) == text(calls[1].prompt_ids) + text([9, 2])
    assert sample.num_loss_tokens == len(sampled) + 2
    assert [len(s.samples) for s in (build_samples(calls),)] == [2]  # no tokenizer: unproven, so a fork


def test_a_constrained_calls_tokens_are_context_not_trained():
    """Issue 26.7: tokens the engine decoded under a grammar or schema were forced, not sampled: the sample keeps
    them (the next call extends them cleanly) with loss mask 0; the free call after them is trained."""
    forced = CallRecord(0, (1, 2), (30, 31, 32), (-0.1, -0.2, -0.3), constrained=True)
    free = CallRecord(1, (1, 2, 30, 31, 32, 5), (40, 41), (-0.4, -0.5))
    [sample] = build_samples([forced, free]).samples
    assert sample.token_ids == (1, 2, 30, 31, 32, 5, 40, 41)
    assert sample.loss_mask == (0, 0, 0, 0, 0, 0, 1, 1)
    assert sample.logprobs == (0.0,) * 6 + (-0.4, -0.5)
    assert build_samples([forced]).samples == ()  # nothing sampled: no sample to train


def _choices(seq, prompt, completions):
    """The records of one call at `seq` that asked for n = len(completions), as proxy.recording.per_choice makes."""
    return [CallRecord(seq + k, prompt, ids, tuple(-0.1 * (i + 1) for i in range(len(ids))), choice=k)
            for k, ids in enumerate(completions)]


def test_only_the_choice_a_later_call_continues_is_trained_the_discarded_stay_context():
    """Issue 26.10: a harness asked for n = 3 and went on with choice 1; choices 0 and 2 were discarded, so they
    are not trained with the rollout's advantage. The first turn, shared by the sample of choice 0, stays trained."""
    first = CallRecord(0, (1, 2), (3, 4), (-0.5, -0.6))
    n_call = _choices(1, (1, 2, 3, 4, 5), [(60, 61), (70, 71), (80, 81)])
    follow_up = CallRecord(4, (1, 2, 3, 4, 5, 70, 71, 9), (90,), (-0.7,))
    samples = build_samples([first, *n_call, follow_up]).samples
    by_calls = {s.call_seqs: s for s in samples}
    assert set(by_calls) == {(0, 1), (2, 4)}  # choice 0 extended the first turn's sample; choice 1 forked
    kept_first = by_calls[(0, 1)]
    assert kept_first.token_ids == (1, 2, 3, 4, 5, 60, 61)
    assert kept_first.loss_mask == (0, 0, 1, 1, 0, 0, 0)  # the first turn trained, discarded choice 0 not
    assert [(s.call_seq, s.sampled) for s in kept_first.spans] == [(0, False), (0, True), (1, False), (1, False)]
    continued = by_calls[(2, 4)]
    assert continued.token_ids == (1, 2, 3, 4, 5, 70, 71, 9, 90)
    assert continued.loss_mask == (0, 0, 0, 0, 0, 1, 1, 0, 1)
    assert continued.logprobs[5:7] == (-0.1, -0.2) and continued.versions[5] == 0
    # Choice 2 is nobody's continuation and its sample trains nothing: no sample at all.
    assert all(2 + 1 not in s.call_seqs for s in samples)


def test_when_no_later_call_continues_any_choice_all_are_trained():
    """The rule's other half: the last call of a rollout asked for n = 2 (a vote, or a best-of-n the harness picked
    from): nothing says which the outcome rests on, so both are trained."""
    samples = build_samples(_choices(0, (1, 2), [(30, 31), (40,)])).samples
    assert [(s.call_seqs, s.loss_mask) for s in samples] == [((0,), (0, 0, 1, 1)), ((1,), (0, 0, 1))]


def test_a_call_of_one_choice_is_never_taken_for_a_sibling():
    # Two separate calls with the same prompt (a retry): both choice 0, so the rule does not apply.
    retry = [CallRecord(0, (1, 2), (3,), (-0.1,)), CallRecord(1, (1, 2), (4,), (-0.2,)),
             CallRecord(2, (1, 2, 4, 5), (6,), (-0.3,))]
    samples = build_samples(retry).samples
    assert sorted(s.num_loss_tokens for s in samples) == [1, 2]


# ---- issue 40.7: the cut is searched on the tails past the common prefix, and equals the whole-text scan's ------

SPACED = {**VOCAB, 50: " ", **{60 + i: " " + chr(ord("a") + i) for i in range(26)}}
"""A SentencePiece-like vocabulary: a space token and space-prefixed letters, whose decoder drops one leading space."""


def decode_joined(ids):
    return "".join(SPACED[i] for i in ids)


def decode_spaced(ids):
    text = decode_joined(ids)
    return text[1:] if text.startswith(" ") else text


def retokenize_spaced(ids):
    """Bigrams as in `retokenize`, and a space followed by a letter as one space-prefixed token."""
    out = []
    for i in retokenize(ids):
        if out and out[-1] == 50 and i < 26:
            out[-1] = 60 + i
        else:
            out.append(i)
    return out


spaced_ids = st.lists(st.sampled_from([*range(26), 50, 100, 101, 102, 60, 61, 62]), max_size=40)


@settings(max_examples=300, deadline=None)
@given(context=spaced_ids, sampled=spaced_ids.filter(bool), inserted=spaced_ids, edit=st.integers(-1, 90),
       value=st.sampled_from([0, 1, 2, 50, 60, 100]), spaced=st.booleans())
def test_the_tail_cut_equals_the_whole_text_scan(context, sampled, inserted, edit, value, spaced):
    """Re-rendered histories (bigrams, space merges), some with one token edited so the texts differ: the cut
    searched on the tails is the reference's (the whole context decoded for every candidate), None included."""
    decode_fn, rerender = (decode_spaced, retokenize_spaced) if spaced else (decode_joined, retokenize)
    tokens = context + sampled
    prompt = rerender(tokens) + inserted
    if 0 <= edit < len(prompt):
        prompt[edit] = value
    assert realign_cut(tokens, prompt, decode_fn) == reference_realign_cut(tokens, prompt, decode_fn)


@pytest.mark.parametrize("context", [[5], [5] * 20, [50] * 20], ids=["short", "long", "spaces"])
def test_a_space_the_decoder_drops_at_a_tails_start_proves_nothing(context):
    """'f ab' and 'fab' differ, though their tails past the common prefix, ' ab' and 'ab', decode alike once the
    decoder has dropped a leading space: the tails begin on shared tokens, and the cut is proven on the whole texts."""
    tokens, prompt = context + [60, 1], context + [0, 1, 7]
    assert reference_realign_cut(tokens, prompt, decode_spaced) is None
    assert realign_cut(tokens, prompt, decode_spaced) is None
    assert realign_cut(context + [50, 0, 1], context + [60, 1, 7], decode_spaced) == len(context) + 2


def test_the_tail_cut_equals_the_whole_text_scan_with_the_real_tiny_tokenizer():
    """Byte-level BPE on texts with multi-byte characters, sampled in non-canonical pieces (a character may be
    split across tokens), re-encoded canonically; some with the text changed after the sampled part."""
    import random

    from trainer.models import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    rng = random.Random(40)
    words = ["the", " answer", " is", " 408", "é", "中文", "🙂", "\n", " CALC:", "12*34", "  ", "ß"]
    text = lambda ids: tok.decode(list(ids))  # noqa: E731
    found = 0
    for _ in range(150):
        context = "".join(rng.choices(words, k=rng.randint(0, 30)))
        reply = "".join(rng.choices(words, k=rng.randint(1, 12)))
        cuts = sorted(rng.sample(range(len(reply) + 1), min(3, len(reply) + 1)))
        pieces = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)]) if b > a]
        sampled = [i for piece in pieces for i in tok.encode(piece, add_special_tokens=False)]
        if rng.random() < 0.3:  # a split inside a multi-byte character: raw bytes as their own tokens
            sampled = [i for ch in reply for i in tok.encode(ch, add_special_tokens=False)]
        after = rng.choice(["", " RESULT", "🙂 ok"]) if rng.random() < 0.7 else rng.choice(words)
        tokens = tok.encode(context, add_special_tokens=False) + sampled
        prompt = tok.encode(context + reply + after, add_special_tokens=False)
        if rng.random() < 0.2:
            prompt = tok.encode(context + reply[::-1] + after, add_special_tokens=False)
        cut = realign_cut(tokens, prompt, text)
        assert cut == reference_realign_cut(tokens, prompt, text), (context, reply, after)
        found += cut is not None
    assert found > 30  # the cases did realign, not only fork


def test_a_realign_decodes_the_long_context_only_to_prove_the_cut():
    """Issue 40.7: main decoded the whole context for every candidate cut (quadratic in an agent's context). Now
    the candidates are tails past the common prefix, and the whole texts are decoded once each for the proof."""
    context = [i % 26 for i in range(10_000)]
    tokens = context + [0, 1] * 20  # the engine sampled 'abab...' as letters
    prompt = context + [100] * 20 + [7]  # the harness re-rendered them as the bigram 'ab'
    seen = []

    def counting(ids):
        seen.append(len(ids))
        return decode(ids)

    assert realign_cut(tokens, prompt, counting) == len(context) + 20
    assert sum(n >= len(context) for n in seen) == 2
    assert sum(seen) < 3 * len(tokens)
