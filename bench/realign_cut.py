"""Benchmark: realign_cut on a long agent context, the whole-context scan (before issue 40.7) vs the tail scan.

An agent's context of `--context-tokens` tokens ends with a reply the engine sampled in non-canonical pieces; the
harness re-rendered the reply canonically (`--tail-tokens` tokens) and went on. Finding where the sampled reply
ends in the new prompt is the realign of trainer.samples.build_samples. Before, every candidate cut decoded the
whole context (quadratic in it); now the candidates decode only the tails past the common prefix and the cut
found is proven once on the whole texts. Both run here side by side with the real tiny tokenizer's decode (what a
run passes), alternated over `--repeats`, best time of each; both must return the same cut.

Prints `RESULT realign_cut context_tokens=<common prefix> tail_tokens=<candidate cuts> before_s=<x> after_s=<y>
speedup=<x/y>`.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from tests.trainer.realign_reference import reference_realign_cut  # noqa: E402
from trainer.models import build_tiny_tokenizer  # noqa: E402
from trainer.samples import realign_cut  # noqa: E402

WORDS = ("the answer is 408 def foo(x): return x * 2 CALC: 12*34 RESULT tool call output file path src main "
         "é 中文 🙂 {\"name\": \"edit\", \"arguments\": {}}").split(" ")


def text_of(tok, rng: random.Random, tokens: int) -> str:
    """Random agent-like text of the fewest words that make at least `tokens` tokens."""
    words = [rng.choice(WORDS) for _ in range(tokens)]  # every word is at least one token
    count = lambda n: len(tok.encode(" ".join(words[:n]), add_special_tokens=False))  # noqa: E731
    low, high = 1, len(words)
    while low < high:
        mid = (low + high) // 2
        low, high = (mid + 1, high) if count(mid) < tokens else (low, mid)
    return " ".join(words[:low])


def make_case(tok, context_tokens: int, tail_tokens: int, seed: int) -> tuple[list[int], list[int], int]:
    """(sample tokens, next prompt, expected cut): the context, the reply as sampled, the reply re-rendered."""
    rng = random.Random(seed)
    context = tok.encode(text_of(tok, rng, context_tokens) + "\n", add_special_tokens=False)
    reply = text_of(tok, rng, tail_tokens)
    # The engine's pieces: the first split inside the first word, then splits inside words.
    cuts = [1, *sorted(rng.sample(range(2, len(reply)), min(40, len(reply) - 2)))]
    sampled = [i for a, b in zip([0, *cuts], [*cuts, len(reply)])
               for i in tok.encode(reply[a:b], add_special_tokens=False)]
    rendered = tok.encode(reply, add_special_tokens=False)
    prompt = context + rendered + tok.encode("\nRESULT: ok", add_special_tokens=False)
    return context + sampled, prompt, len(context) + len(rendered)


def timed(cut_fn, tokens, prompt, decode) -> tuple[float, int | None]:
    start = time.perf_counter()
    cut = cut_fn(tokens, prompt, decode)
    return time.perf_counter() - start, cut


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context-tokens", type=int, default=32_768)
    parser.add_argument("--tail-tokens", type=int, default=2_048)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    tok = build_tiny_tokenizer()
    tok.model_max_length = sys.maxsize  # encoding a long context is the point here, not a mistake to warn about
    decode = lambda ids: tok.decode(list(ids))  # noqa: E731  (what runs.orchestrator passes: tokenizer.decode)
    tokens, prompt, expected = make_case(tok, args.context_tokens, args.tail_tokens, seed=0)
    common = next(i for i, (a, b) in enumerate(zip(tokens, prompt)) if a != b)
    print(f"sample {len(tokens)} tokens, next prompt {len(prompt)} tokens, common prefix {common}, "
          f"cut expected at {expected} ({expected - common} candidate cuts)")
    best = {"before": float("inf"), "after": float("inf")}
    for _ in range(args.repeats):
        for name, cut_fn in (("before", reference_realign_cut), ("after", realign_cut)):
            seconds, cut = timed(cut_fn, tokens, prompt, decode)
            if cut != expected:
                raise SystemExit(f"{name}: cut {cut}, expected {expected}")
            best[name] = min(best[name], seconds)
            print(f"{name:6s} {seconds:8.3f} s  cut {cut}")
    before, after = best["before"], best["after"]
    print(f"RESULT realign_cut context_tokens={common} tail_tokens={expected - common} before_s={before:.3f} "
          f"after_s={after:.3f} speedup={before / after:.1f}")


if __name__ == "__main__":
    main()
