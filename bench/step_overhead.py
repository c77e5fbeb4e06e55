"""Benchmark: one demo training step through the product versus a bare in-process loop of the same trainer parts.

    flock /tmp/lw-heavy.lock .venv/bin/python bench/step_overhead.py --steps 4

The product way is a real run on a fresh data dir (SQLite and the embedded Redis, whatever the environment
says): a Celery worker subprocess claims it and drives vLLM, the recording proxy, one harness subprocess per
attempt (examples/arith/agent.py), the reward sandbox and the database, exactly as `./lw up` would. Its step
times are the run's own `time/*` metrics.

The bare way is an asyncio loop in this process with the same trainer parts: the same vLLM server start and
weight sync (trainer.engine), the same agent protocol and prompts (examples/arith/agent.py, its functions
imported), calls to vLLM with httpx carrying the body the proxy would send, the reward function called in
process, trainer.samples.build_samples, trainer.algorithms and trainer.policy.Policy.train_step.

Both run the demo preset's config (examples/arith/preset.json: SmolLM2-135M-Instruct, 8 tasks x 4 attempts,
bfloat16, T=0.7), evaluation off, on the same tasks
(the same seeded choice per group as runs.harness_source), one after the other: each needs the whole machine,
and two engines and two trainers at once would not fit in memory beside the other users of this box. Step 1 is
a warm-up (allocator, first compile of shapes) and is left out of the medians.

Last line: RESULT product_vs_bare=<median product step / median bare step> and the medians of each part.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere

DEMO = REPO / "examples" / "arith"
PRESET = json.loads((DEMO / "preset.json").read_text())
"""The demo run's preset (runs.management.commands.load_demo reads the same file): model, names, config."""
MODEL = PRESET["model"]
PARTS = ("generate", "score", "record", "build_samples", "train", "sync", "checkpoint", "idle")
DEMO_CONFIG = {**PRESET["config"], "eval_tasks": 0, "eval_greedy": False}
"""The demo step; evaluation off (it is not part of a training step)."""


def load_example(name: str):
    """examples/arith/<name>.py as a module (the agent's prompts and protocol, the reward function)."""
    spec = importlib.util.spec_from_file_location(f"arith_{name}", DEMO / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train_tasks() -> list[dict]:
    """The demo dataset's train tasks in file order (= the order of their database ids after upload)."""
    rows = [json.loads(line) for line in (DEMO / "tasks.jsonl").read_text().splitlines() if line.strip()]
    return [row for row in rows if row.get("split", "train") == "train"]


def group_task(tasks: list, seed: int, group_id: int):
    """The task of a group, chosen as runs.harness_source.HarnessSource.launch chooses it."""
    return random.Random(seed * 1_000_003 + group_id).choice(tasks)


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of a process and its live descendants, their reaped children included.

    Harnesses and reward sandboxes are reaped by the worker, so they count in its children's time; the engine's
    processes are live descendants. Two ways doing the same work should burn the same CPU: the difference is
    the product's own work, and unlike wall time it hardly moves when other jobs share the machine.
    """
    from common.procs import descendants

    ticks = 0
    for member in [pid, *descendants(pid)]:
        try:
            fields = Path(f"/proc/{member}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        ticks += sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
    return ticks / os.sysconf("SC_CLK_TCK")


# ---- the product ------------------------------------------------------------------------------------------

class Product:
    """A fresh data dir with the demo loaded, a Celery worker subprocess, and one run through it."""

    def __init__(self, data_dir: Path, models_dir: Path):
        self.data_dir, self.models_dir = data_dir, models_dir
        self.worker: subprocess.Popen | None = None

    def setup(self) -> None:
        for key in ("DATABASE_URL", "REDIS_URL"):  # a fresh data dir: its own SQLite and embedded Redis
            os.environ.pop(key, None)
        # The embedded Redis ends with this process, however it ends (lightning_web/embedded_redis.py).
        os.environ.update(LIGHTNING_DATA_DIR=str(self.data_dir), LIGHTNING_MODELS_DIR=str(self.models_dir),
                          DJANGO_SETTINGS_MODULE="lightning_web.settings",
                          LIGHTNING_EMBEDDED_REDIS_OWNER=str(os.getpid()))
        import django

        django.setup()
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per engine call otherwise
        from django.contrib.auth import get_user_model
        from django.core.management import call_command

        from catalog.management.commands.models import ensure_smollm2

        call_command("migrate", interactive=False, verbosity=0)
        self.user = get_user_model().objects.create_user("bench", password="bench-password")
        call_command("load_demo", username="bench", verbosity=0)
        ensure_smollm2(lambda line: print(f"  {line}", flush=True))

    def model_folder(self) -> Path:
        from catalog.registry import registered_models

        return Path(next(m.path for m in registered_models() if m.name == MODEL))

    def start_worker(self) -> None:
        from django.conf import settings

        env = dict(os.environ, REDIS_URL=settings.REDIS_URL, LIGHTNING_DATA_DIR=str(self.data_dir))
        log = open(self.data_dir / "worker.log", "ab")
        self.worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "lightning_web", "worker", "-Q", "runs,default", "--pool", "solo",
             "--loglevel", "INFO", "-n", f"bench@{os.uname().nodename}"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def run(self, config: dict) -> tuple[int, str]:
        """Create the demo run through the services (as the API does), wait for its end; (run id, status)."""
        from catalog.models import Dataset, Harness, RewardScript
        from runs import services
        from runs.models import Run

        run = services.create_run(self.user, name="step-overhead", model=MODEL, config=config,
                                  harness=Harness.objects.get(owner=self.user, name=PRESET["harness"]),
                                  dataset=Dataset.objects.get(owner=self.user, name=PRESET["dataset"]),
                                  reward_script=RewardScript.objects.get(owner=self.user,
                                                                         name=PRESET["reward_script"]))
        step, started = -1, time.monotonic()
        self.cpu_at_step: dict[int, float] = {}  # worker tree CPU seconds when the run's step became this one
        while True:
            run = Run.objects.get(pk=run.pk)
            if run.step != step:
                step = run.step
                self.cpu_at_step[step] = tree_cpu_seconds(self.worker.pid)
                print(f"  product: {time.monotonic() - started:6.0f} s  step {step}/{config['steps']} ({run.status})",
                      flush=True)
            if run.is_finished:
                return run.pk, f"{run.status} {run.error}".strip()
            if self.worker.poll() is not None:
                raise SystemExit(f"the worker exited with code {self.worker.returncode}; "
                                 f"see {self.data_dir / 'worker.log'}")
            time.sleep(0.2)

    def step_times(self, run_id: int) -> dict[int, dict[str, float]]:
        from runs.models import Metric

        steps: dict[int, dict[str, float]] = {}
        for step, name, value in Metric.objects.filter(run_id=run_id).values_list("step", "name", "value"):
            if name.startswith("time/") or name.startswith("train/tokens"):
                steps.setdefault(step, {})[name.split("/", 1)[1]] = value
        for step in steps:  # step k's report is stored at its end: CPU from step k-1's report to step k's
            if step - 1 in self.cpu_at_step and step in self.cpu_at_step:
                steps[step]["cpu"] = self.cpu_at_step[step] - self.cpu_at_step[step - 1]
        return steps

    def rollout_latencies(self, run_id: int) -> dict[str, float]:
        """Medians over train rollouts of the harness-side delays on a step's path, from the recorded rows.

        first_call: rollout started (row updated before the subprocess) to its first call entering the proxy
        (process start, imports, directory lookup); gap: one call recorded to the next entering (harness turn,
        proxy admission); tail: last call recorded to the rollout finished (exit, reading calls, reward sandbox).
        """
        from runs.models import ModelCall, Rollout

        first, gaps, tails = [], [], []
        for rollout in Rollout.objects.filter(run_id=run_id, split="train", step__gte=1):
            calls = list(ModelCall.objects.filter(rollout=rollout).order_by("seq")
                         .values_list("created_at", "latency_ms"))
            if not calls or rollout.started_at is None or rollout.finished_at is None:
                continue
            entered = [(end.timestamp() - ms / 1000, end.timestamp()) for end, ms in calls]
            first.append(entered[0][0] - rollout.started_at.timestamp())
            gaps += [b[0] - a[1] for a, b in zip(entered, entered[1:])]
            tails.append(rollout.finished_at.timestamp() - entered[-1][1])
        med = lambda xs: statistics.median(xs) if xs else 0.0  # noqa: E731
        return {"harness_first_call": med(first), "harness_gap": med(gaps), "harness_tail": med(tails)}

    def stop(self) -> None:
        if self.worker is not None and self.worker.poll() is None:
            from common.procs import kill_group

            kill_group(self.worker.pid, grace_s=30)
            self.worker.wait()
        from lightning_web import embedded_redis

        embedded_redis.stop(self.data_dir)  # the embedded Redis this data dir started


# ---- the bare loop ----------------------------------------------------------------------------------------

class BareLoop:
    """Sync GRPO steps over vLLM with nothing between the trainer and the engine but httpx."""

    def __init__(self, folder: Path, config, workdir: Path, tasks: list[dict]):
        self.folder, self.config, self.workdir, self.tasks = folder, config, workdir, tasks
        self.agent, self.reward = load_example("agent"), load_example("reward").reward
        self.next_group = 0

    async def run(self, steps: int) -> list[dict[str, float]]:
        import httpx
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from trainer.engine import EngineConfig, serving_engine
        from trainer.policy import Policy

        c = self.config.for_this_host()  # `auto` dtypes as a run on this host resolves them
        torch.manual_seed(c.seed)
        random.seed(c.seed)
        tokenizer = AutoTokenizer.from_pretrained(self.folder)
        policy = Policy(AutoModelForCausalLM.from_pretrained(self.folder, dtype=torch.float32), c)
        engine_config = EngineConfig(model_path=str(self.folder), max_model_len=c.max_model_len,
                                     kv_cache_gb=c.kv_cache_gb, seed=c.seed, dtype=c.engine_dtype)
        times = []
        async with serving_engine(engine_config, self.workdir / "engine") as engine:
            limits = httpx.Limits(max_connections=c.tasks_per_step * c.group_size)
            async with httpx.AsyncClient(base_url=engine.base_url + "/v1", timeout=600, limits=limits) as http:
                for step in range(1, steps + 1):
                    times.append(await self.step(http, engine, policy, tokenizer.decode))
                    t = times[-1]
                    print(f"  bare: step {step}/{steps}  {t['step']:6.1f} s  (generate {t['generate']:.1f}, "
                          f"train {t['train']:.1f}, sync {t['sync']:.2f}: write {t['sync_write']:.2f} "
                          f"{'in place' if t['sync_in_place'] else 'new file'}, reload {t['sync_reload']:.2f})",
                          flush=True)
        return times

    async def step(self, http, engine, policy, decode) -> dict[str, float]:
        import torch

        from trainer.algorithms import broadcast_to_samples, compute_advantages
        from trainer.samples import build_samples

        c, clock, cpu = self.config, _Stopwatch(), tree_cpu_seconds(os.getpid())
        groups = [(self.next_group + g, group_task(self.tasks, c.seed, self.next_group + g))
                  for g in range(c.tasks_per_step)]
        self.next_group += c.tasks_per_step
        episodes = await asyncio.gather(*(self.episode(http, task, engine.version)
                                          for _, task in groups for _ in range(c.group_size)))
        clock.lap("generate")
        tasks = [task for _, task in groups for _ in range(c.group_size)]
        rewards = [float(self.reward(task, {"answer": answer, "turns": turns})["reward"])
                   for task, (_, answer, turns) in zip(tasks, episodes)]
        clock.lap("score")
        group_of = torch.tensor([g for g, _ in groups for _ in range(c.group_size)])
        advantages, _ = compute_advantages(c.advantage, torch.tensor(rewards, dtype=torch.float64), group_of,
                                           c.adv_eps)
        samples, owners = [], []
        for i, (calls, _, _) in enumerate(episodes):
            for sample in build_samples(calls, decode).samples:
                samples.append(sample)
                owners.append(i)
        sample_adv = broadcast_to_samples(advantages, torch.tensor(owners, dtype=torch.long)).tolist()
        clock.lap("build_samples")
        metrics = await asyncio.to_thread(policy.train_step, samples, sample_adv, owners)
        clock.lap("train")
        await engine.pause()
        try:
            await engine.update_weights(policy.model, policy.version)
        finally:
            await engine.resume()
        clock.lap("sync")
        timings = getattr(engine, "last_timings", {})
        return {**clock.parts, "step": clock.total, "record": 0.0, "checkpoint": 0.0, "idle": 0.0,
                "cpu": tree_cpu_seconds(os.getpid()) - cpu,
                "tokens": metrics["train/tokens"], "tokens_per_s": metrics["train/tokens_per_s"],
                "sync_write": timings.get("write_s", 0.0), "sync_reload": timings.get("reload_s", 0.0),
                "sync_in_place": timings.get("in_place", 0.0)}

    async def episode(self, http, task: dict, version: int):
        """examples/arith/agent.py's main loop in process: the same messages, turns and parsing."""
        from proxy.assemble import extract_tokens
        from proxy.sampling import enforce_sampling
        from trainer.samples import CallRecord

        agent = self.agent
        messages = [{"role": "system", "content": agent.SYSTEM}, *agent.demo_turns(),
                    {"role": "user", "content": task["question"]}]
        calls, answer = [], None
        for seq in range(3):
            asked = {"model": "policy", "messages": messages, "max_tokens": 64, "temperature": 0.7}
            body, _ = enforce_sampling(asked, self.config.sampling)  # what the proxy sends upstream
            response = await http.post("/chat/completions", json={**body, "return_token_ids": True, "logprobs": True})
            response.raise_for_status()
            data = response.json()
            tokens = extract_tokens(data)
            calls.append(CallRecord(seq, tuple(tokens.prompt_ids), tuple(tokens.completion_ids),
                                    tuple(tokens.logprobs), tokens.finish_reason or "stop", version))
            reply = data["choices"][0]["message"]["content"] or ""
            messages.append({"role": "assistant", "content": reply})
            found = agent.ANSWER.search(reply)
            if found:
                answer = found.group(1)
                break
            calc = agent.CALC.search(reply)
            messages.append({"role": "user", "content": f"RESULT: {agent.safe_eval(calc.group(1))}" if calc
                             else "Write CALC: <expression> or ANSWER: <number>."})
        return tuple(calls), answer, len(messages)


class _Stopwatch:
    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.parts: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.parts[name] = self.parts.get(name, 0.0) + now - self.last
        self.last = now

    @property
    def total(self) -> float:
        return time.perf_counter() - self.start


# ---- report -----------------------------------------------------------------------------------------------

def medians(steps: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for s in steps for k in s})
    return {k: statistics.median(s.get(k, 0.0) for s in steps) for k in keys}


def print_table(name: str, steps: list[dict[str, float]]) -> None:
    print(f"\n{name}: per step (s)")
    columns = ("step",) + PARTS + ("tokens_per_s", "cpu")
    print("  step " + " ".join(f"{k:>13}" for k in columns))
    for i, s in enumerate(steps, start=1):
        print(f"  {i:4d} " + " ".join(f"{s.get(k, 0.0):13.2f}" for k in columns))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="steps each way; the first is a warm-up")
    parser.add_argument("--models-dir", default=str(REPO / "data" / "models"),
                        help="model registry (SmolLM2 is imported there once if missing)")
    parser.add_argument("--data-dir", help="fresh data dir for the product (default: a new temporary one)")
    parser.add_argument("--config", default="{}", help="JSON overrides of the demo TrainerConfig, both ways")
    parser.add_argument("--only", choices=("product", "bare"), help="measure one way only (no ratio)")
    args = parser.parse_args()
    if args.steps < 2:
        raise SystemExit("--steps must be at least 2: step 1 is a warm-up")
    data_dir = Path(args.data_dir or tempfile.mkdtemp(prefix="lw-step-overhead-")).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    config_dict = {**DEMO_CONFIG, **json.loads(args.config), "steps": args.steps}
    product = Product(data_dir, Path(args.models_dir).resolve())
    print(f"data dir {data_dir}; config {config_dict}", flush=True)
    results: dict[str, list[dict[str, float]]] = {}
    try:
        product.setup()
        from trainer.config import TrainerConfig

        config = TrainerConfig.from_dict(config_dict)
        if args.only != "product":
            print("bare loop: engine start, then steps", flush=True)
            bare = BareLoop(product.model_folder(), config, data_dir / "bare", train_tasks())
            results["bare"] = asyncio.run(bare.run(args.steps))
        if args.only != "bare":
            print("product: a Celery worker runs the demo run", flush=True)
            product.start_worker()
            run_id, status = product.run(config_dict)
            if not status.startswith("succeeded"):
                raise SystemExit(f"the product run {run_id} ended {status}; see {data_dir / 'worker.log'}")
            by_step = product.step_times(run_id)
            results["product"] = [by_step[s] for s in sorted(by_step)]
            latencies = product.rollout_latencies(run_id)
    finally:
        product.stop()
    for name, steps in results.items():
        print_table(name, steps)
    for steps in results.values():
        for step in steps:
            step["outside_train"] = step["step"] - step.get("train", 0.0)
    summary = {name: medians(steps[1:]) for name, steps in results.items()}
    fields = []
    if len(summary) == 2:
        product, bare = summary["product"], summary["bare"]
        fields.append(f"product_vs_bare={product['step'] / bare['step']:.2f}")
        # Training is the same code both ways and the noisiest part on a shared machine: the rest of the step
        # (generation, scoring, recording, sync, idle) is where the product's own overhead shows.
        fields.append(f"outside_train_vs_bare={product['outside_train'] / bare['outside_train']:.2f}")
        if product.get("cpu") and bare.get("cpu"):
            fields.append(f"cpu_product_vs_bare={product['cpu'] / bare['cpu']:.2f}")
    for name, m in summary.items():
        fields += [f"{name}_{k}_s={m.get(k, 0.0):.2f}" for k in ("step", "outside_train") + PARTS]
        fields.append(f"{name}_tokens_per_s={m.get('tokens_per_s', 0.0):.0f}")
        fields.append(f"{name}_cpu_s={m.get('cpu', 0.0):.1f}")
    if "product" in results:
        print("\nproduct rollouts after step 1, medians (s): "
              + "  ".join(f"{k} {v:.2f}" for k, v in latencies.items()))
    print(f"\nmedians over steps 2-{args.steps}")
    print("RESULT " + " ".join(fields))


if __name__ == "__main__":
    main()
