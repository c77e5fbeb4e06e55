"""Speed of each number format on this host, and what `auto` picks: the engine (vLLM) and the trainer, bfloat16 and
float32 side by side, on the host as it is and again with torch and oneDNN limited to AVX2.

    flock /tmp/lw-heavy.lock .venv/bin/python bench/cpu_speed.py                 # SmolLM2 from data/models
    .venv/bin/python bench/cpu_speed.py --model /path/to/model --isas native     # one setting only

Each ISA setting runs in a child process of its own (torch reads ATEN_CPU_CAPABILITY once, when it first
dispatches), with the limits of trainer.host.ISA_LIMITS in its environment and so in its vLLM servers'. There:
- the host profile and what `auto` resolves to (trainer.host.resolve), as a run's worker records it;
- engine decode: for bfloat16 and float32, one vLLM server each (the served folder in that dtype, as a run serves
  it), `--concurrency` calls at once of `--tokens` generated tokens each (ignore_eos), tokens/s over the batch;
  one warm-up call first. Then 8 sampled calls at T=0.7 whose engine logprobs the trainer recomputes (below);
- trainer: for bfloat16 autocast and float32, Policy.train_step (trainer logprobs, forward, backward, AdamW) on
  samples of the demo's length (`--prompt-tokens` context + `--completion-tokens` trained), after one warm-up
  step, repeated until `--train-seconds` have passed; tokens/s = tokens trained over their wall time. Then the
  mismatch: mean |engine - trainer| logprob of the engine's sampled tokens, each dtype with its own engine's, on
  8 first calls of the demo agent (examples/arith: system prompt, two worked episodes, a train question) and on 8
  prose answers (higher entropy: bfloat16's rounding shows more there).

Last line: RESULT engine_auto_vs_best=<x> engine_auto_vs_best_avx2=<x> trainer_auto_vs_best=<x>
trainer_auto_vs_best_avx2=<x> engine_tok_s=<auto, 32 concurrent> engine_tok_s_avx2=<...> trainer_tok_s=<...>
trainer_tok_s_avx2=<...> (then the auto picks and mismatches), where *_vs_best is auto's throughput over the faster
dtype's on that setting (1.0 when auto picked the faster one); mismatch_auto* are auto's dtypes' mismatches.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from trainer.host import ISA_LIMITS, LIMIT_VARIABLES  # noqa: E402

DTYPES = ("bfloat16", "float32")
PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a bicycle gear works.",
           "List ten uses for a paperclip and say why each works.", "Describe the water cycle to a child."]
MISMATCH_CALLS = 8
TEMPERATURE = 0.7
DEMO = REPO / "examples" / "arith"


def demo_messages(i: int) -> list[dict]:
    """The demo agent's first call on train task i: its system prompt, two worked episodes, the question."""
    sys.path.insert(0, str(DEMO))
    import agent  # examples/arith/agent.py: the demo's harness, unchanged

    tasks = [json.loads(line) for line in (DEMO / "tasks.jsonl").read_text().splitlines() if line.strip()]
    question = [t for t in tasks if t["split"] == "train"][i]["question"]
    return [{"role": "system", "content": agent.SYSTEM}, *agent.demo_turns(), {"role": "user", "content": question}]


def child(args) -> dict:
    """Everything measured under one ISA setting (this process's environment)."""
    import torch

    from trainer.host import detect, resolve

    profile = detect()
    auto = resolve(profile)
    print(f"[{args.isa}] {profile.describe()}; auto -> {auto.describe()}", flush=True)
    report = {"isa": args.isa, "host": profile.describe(), "torch_capability": profile.torch_capability,
              "auto": {"engine": auto.engine_dtype, "trainer": auto.trainer_dtype}, "engine": {}, "trainer": {},
              "mismatch": {}, "mismatch_prose": {}}
    sampled = {}
    for dtype in DTYPES:
        decode, calls = asyncio.run(engine_speed(args, dtype))
        report["engine"][dtype], sampled[dtype] = decode, calls
    torch.manual_seed(0)
    for dtype in DTYPES:
        tokens_s, demo, prose = trainer_speed(args, dtype, *sampled[dtype])
        report["trainer"][dtype], report["mismatch"][dtype], report["mismatch_prose"][dtype] = tokens_s, demo, prose
    return report


async def engine_speed(args, dtype: str) -> tuple[dict[int, float], tuple[list, list]]:
    """{concurrency: tokens/s} for one vLLM server in `dtype`, and MISMATCH_CALLS sampled calls of the demo and of
    prose (each: prompt ids, completion ids, engine logprobs) for the trainer to recompute."""
    import httpx

    from trainer.engine import EngineConfig, serving_engine

    config = EngineConfig(model_path=str(args.model), max_model_len=1024, kv_cache_gb=1.0, dtype=dtype,
                          cache_dir=str(args.cache_dir))
    started = time.perf_counter()
    async with serving_engine(config, Path(tempfile.mkdtemp(prefix=f"cpu-speed-{dtype}-"))) as engine, \
            httpx.AsyncClient(base_url=engine.base_url + "/v1", timeout=1800) as client:
        print(f"[{args.isa}] engine {dtype}: up in {time.perf_counter() - started:.0f} s", flush=True)

        async def call(i: int, tokens: int, messages: list[dict] | None = None, **extra) -> dict:
            body = {"model": config.served_model_name, "max_tokens": tokens,
                    "messages": messages or [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], **extra}
            response = await client.post("/chat/completions", json=body)
            if response.is_error:
                raise SystemExit(f"engine {dtype} answered {response.status_code}: {response.text[:500]}")
            return response.json()

        await call(0, 16)  # warm-up
        speeds = {}
        for concurrency in args.concurrency:
            began = time.perf_counter()
            answers = await asyncio.gather(*(call(i, args.tokens, temperature=TEMPERATURE, ignore_eos=True)
                                             for i in range(concurrency)))
            seconds = time.perf_counter() - began
            speeds[concurrency] = sum(a["usage"]["completion_tokens"] for a in answers) / seconds
            print(f"[{args.isa}] engine {dtype}: {concurrency:>2} concurrent: {speeds[concurrency]:6.1f} tok/s "
                  f"({seconds:.1f} s)", flush=True)
        # As a run samples (no ignore_eos: it masks the end token, which vLLM may then report as -inf).
        demo = await asyncio.gather(*(call(i, 64, demo_messages(i), temperature=TEMPERATURE, logprobs=True,
                                           return_token_ids=True) for i in range(MISMATCH_CALLS)))
        prose = await asyncio.gather(*(call(i, 48, temperature=TEMPERATURE, logprobs=True, return_token_ids=True)
                                       for i in range(MISMATCH_CALLS)))

    def recorded(answers):
        return [(a["prompt_token_ids"], a["choices"][0]["token_ids"],
                 [t["logprob"] for t in a["choices"][0]["logprobs"]["content"]]) for a in answers]
    return speeds, (recorded(demo), recorded(prose))


def trainer_speed(args, dtype: str, demo_calls, prose_calls) -> tuple[float, float, float]:
    """Training tokens/s of Policy.train_step in `dtype` on demo-length samples, and the mean |engine - trainer|
    logprob of the demo's and of prose calls (sampled by the engine in the same dtype)."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.config import TrainerConfig
    from trainer.policy import Policy
    from trainer.samples import Sample

    def sample(prompt: list[int], completion: list[int], logprobs: list[float]) -> Sample:
        mask = (0,) * len(prompt) + (1,) * len(completion)
        return Sample(tuple(prompt) + tuple(completion), mask, (0.0,) * len(prompt) + tuple(logprobs),
                      tuple(0 if m else -1 for m in mask), (), (0,), "single")

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    policy = Policy(model, TrainerConfig(dtype=dtype, learning_rate=1e-6, temperature=TEMPERATURE,
                                         max_train_memory_gb=0))

    def mismatch(calls) -> float:
        logprobs, _ = policy.logprobs([sample(*call) for call in calls])  # (M,) every loss token, in sample order
        return (logprobs - torch.tensor([lp for call in calls for lp in call[2]])).abs().mean().item()

    demo, prose = mismatch(demo_calls), mismatch(prose_calls)

    rng = random.Random(0)
    vocab = model.config.vocab_size
    batch = [sample([rng.randrange(vocab) for _ in range(args.prompt_tokens)],
                    [rng.randrange(vocab) for _ in range(args.completion_tokens)], [-1.0] * args.completion_tokens)
             for _ in range(args.samples)]
    advantages = [1.0 if i % 2 else -1.0 for i in range(len(batch))]
    policy.train_step(batch[:1], advantages[:1], [0])  # warm-up: allocator, optimizer state
    tokens, seconds = 0, 0.0
    while seconds < args.train_seconds or tokens == 0:
        began = time.perf_counter()
        policy.train_step(batch, advantages, list(range(len(batch))))
        seconds += time.perf_counter() - began
        tokens += sum(len(s.token_ids) for s in batch)
    print(f"[{args.isa}] trainer {dtype}: {tokens / seconds:6.1f} tok/s ({tokens} tokens in {seconds:.1f} s); "
          f"engine-vs-trainer logprob mismatch {demo:.4f} on the demo's calls, {prose:.4f} on prose", flush=True)
    policy.close()
    return tokens / seconds, demo, prose


def run_child(args, isa: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LIMIT_VARIABLES}
    env.update(ISA_LIMITS.get(isa, {}))
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as out:
        path = Path(out.name)
    argv = [sys.executable, __file__, "--child", "--isa", isa, "--out", str(path), "--model", str(args.model),
            "--cache-dir", str(args.cache_dir), "--tokens", str(args.tokens),
            "--concurrency", ",".join(map(str, args.concurrency)), "--train-seconds", str(args.train_seconds),
            "--samples", str(args.samples), "--prompt-tokens", str(args.prompt_tokens),
            "--completion-tokens", str(args.completion_tokens)]
    subprocess.run(argv, env=env, check=True)
    report = json.loads(path.read_text())
    path.unlink()
    return report


def ratio(measured: dict, auto: str) -> float:
    return measured[auto] / max(measured.values())


def print_tables(reports: list[dict]) -> None:
    for r in reports:
        print(f"\n== {r['isa']}: {r['host']} (torch {r['torch_capability']}); auto -> engine {r['auto']['engine']}, "
              f"trainer {r['auto']['trainer']}")
        concurrencies = sorted(int(c) for c in r["engine"][DTYPES[0]])
        print("engine decode tok/s   " + "".join(f"{c:>6} conc" for c in concurrencies))
        for dtype in DTYPES:
            mark = " (auto)" if dtype == r["auto"]["engine"] else ""
            print(f"  {dtype + mark:<20}" + "".join(f"{r['engine'][dtype][str(c)]:11.1f}" for c in concurrencies))
        print("trainer tok/s          forward+backward+AdamW   mismatch: demo calls   prose")
        for dtype in DTYPES:
            mark = " (auto)" if dtype == r["auto"]["trainer"] else ""
            print(f"  {dtype + mark:<20}{r['trainer'][dtype]:16.1f}{r['mismatch'][dtype]:22.4f}"
                  f"{r['mismatch_prose'][dtype]:11.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="model folder (default: data/models/smollm2-135m-instruct)")
    parser.add_argument("--isas", default="native,avx2", help="ISA settings, comma-separated: native, avx2")
    parser.add_argument("--concurrency", default="1,8,32", help="concurrent calls per measurement")
    parser.add_argument("--tokens", type=int, default=200, help="generated tokens per call")
    parser.add_argument("--train-seconds", type=float, default=20.0, help="least time to train per dtype")
    parser.add_argument("--samples", type=int, default=4, help="samples per timed training step")
    parser.add_argument("--prompt-tokens", type=int, default=215, help="context tokens per sample (the demo's)")
    parser.add_argument("--completion-tokens", type=int, default=60, help="trained tokens per sample (the demo's)")
    parser.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "lw-cpu-speed-cache",
                        help="engine cache: compile caches and served folders")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--isa", default="native", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if args.model is None:
        from trainer.models import default_models_dir

        args.model = default_models_dir() / "smollm2-135m-instruct"
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"no model at {args.model}: import it (`./lw manage models smollm2`) or give --model")
    if args.child:
        args.out.write_text(json.dumps(child(args)))
        return
    isas = args.isas.split(",")
    unknown = set(isas) - {"native", *ISA_LIMITS}
    if unknown:
        raise SystemExit(f"unknown ISA setting(s) {sorted(unknown)}; use native or {sorted(ISA_LIMITS)}")
    reports = [run_child(args, isa) for isa in isas]
    top = max(args.concurrency)
    print_tables(reports)
    fields = []
    for r in reports:
        suffix = "" if r["isa"] == "native" else f"_{r['isa']}"
        engine = {dtype: r["engine"][dtype][str(top)] for dtype in DTYPES}
        fields += [f"engine_auto_vs_best{suffix}={ratio(engine, r['auto']['engine']):.3f}",
                   f"trainer_auto_vs_best{suffix}={ratio(r['trainer'], r['auto']['trainer']):.3f}",
                   f"engine_tok_s{suffix}={engine[r['auto']['engine']]:.1f}",
                   f"trainer_tok_s{suffix}={r['trainer'][r['auto']['trainer']]:.1f}",
                   f"auto{suffix}={r['auto']['engine']}/{r['auto']['trainer']}",
                   f"mismatch_auto{suffix}={r['mismatch'][r['auto']['trainer']]:.4f}",
                   f"mismatch_auto_prose{suffix}={r['mismatch_prose'][r['auto']['trainer']]:.4f}"]
    order = ("engine_auto_vs_best=", "engine_auto_vs_best_", "trainer_auto_vs_best=", "trainer_auto_vs_best_",
             "engine_tok_s=", "engine_tok_s_", "trainer_tok_s=", "trainer_tok_s_", "auto", "mismatch")
    fields.sort(key=lambda f: next(i for i, prefix in enumerate(order) if f.startswith(prefix)))
    print("RESULT " + " ".join(fields))


if __name__ == "__main__":
    main()
