"""Drives one run end to end: setup, engine and proxy, the training loop, cancel at any moment.

The parts live beside it: harness rollouts and scoring (runs.harness_source), evaluation (runs.evaluation), the
gated engine (runs.gated_engine).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from pathlib import Path

from asgiref.sync import sync_to_async
from django.conf import settings

from proxy.app import create_app
from proxy.server import ProxyServer
from proxy.types import UpstreamConfig
from runs import services
from runs.evaluation import Evaluator
from runs.gated_engine import GatedEngine
from runs.harness_source import HarnessSource
from runs.models import Run, RunStatus
from runs.recorder import DjangoRecorder, cached_directory
from trainer import scheduler
from trainer.config import TrainerConfig

logger = logging.getLogger(__name__)
db = sync_to_async


class RunSetupError(RuntimeError):
    """The run cannot start; the message says what to fix."""


def model_folder(run: Run) -> Path:
    """The run's model as a folder the engine and trainer can load, or RunSetupError saying why not."""
    info = run.model_info or {}
    if info.get("origin") == "external":
        raise RunSetupError(f"{run.model} is an external engine: it cannot be trained (no weight sync); "
                            "pick a model from the registry")
    folder = Path(info.get("path") or "")
    if not (folder / "config.json").is_file():
        raise RunSetupError(f"model folder {folder} is gone; import the model again (`./lw manage models ...`)")
    if not any(folder.glob("*.safetensors")):
        raise RunSetupError(f"model folder {folder} holds no *.safetensors weights")
    return folder


def execute(run_id: int) -> str:
    """Run a claimed run to its end; returns the final status. Blocking: the Celery task calls it."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_execute(run_id))
    # Called from a thread that already runs a loop: give the run a thread and a loop of its own.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"run-{run_id}") as pool:
        return pool.submit(asyncio.run, _execute(run_id)).result()


async def _execute(run_id: int) -> str:
    """The run as one task that a cancel stops at any moment: engine start, evaluation, rollouts or training."""
    main = asyncio.create_task(_serve_and_train(run_id))
    watcher = asyncio.create_task(_watch_cancel(run_id, main))
    try:
        return await main
    except asyncio.CancelledError:
        if not watcher.done() or not await _cancel_requested(run_id):
            raise
        # Every process is gone by now: the engine's and the harnesses' context managers ran on the way out.
        await db(services.cancel_unfinished_rollouts)(run_id, "cancelled with its run")
        return await _end(run_id, RunStatus.CANCELLED, "cancelled by its owner")
    finally:
        watcher.cancel()


async def _serve_and_train(run_id: int) -> str:
    run = await db(Run.objects.get)(pk=run_id)
    config = TrainerConfig.from_dict(run.config)
    folder = model_folder(run)
    train_ids = await db(lambda: list(run.dataset.tasks.filter(split="train").values_list("pk", flat=True)))() \
        if run.dataset_id else []
    if not train_ids:
        raise RunSetupError("the run's dataset is gone or has no train tasks")
    if run.harness_snapshot.get("executor", "local") != "local":
        raise RunSetupError(f"harness executor {run.harness_snapshot['executor']!r} is not available in this build; "
                            "use a local harness")
    workdir = Path(settings.LIGHTNING_RUNS_DIR) / f"run-{run_id}"
    await _log(run_id, f"starting the engine for {run.model} (vLLM; about a minute on CPU)")
    from trainer.engine import EngineConfig, serving_engine

    engine_config = EngineConfig(model_path=str(folder), max_model_len=config.max_model_len,
                                 kv_cache_gb=config.kv_cache_gb, seed=config.seed)
    async with serving_engine(engine_config, workdir / "engine") as engine:
        await db(services.transition_run)(run_id, RunStatus.RUNNING)
        upstream = UpstreamConfig(base_url=engine.base_url + "/v1", served_model=engine_config.served_model_name,
                                  sampling=config.sampling)
        app = create_app(cached_directory(ttl_s=0.5), DjangoRecorder(), upstream, policy_version=lambda: engine.version)
        server = ProxyServer(app, host=settings.LIGHTNING_PROXY_HOST, port=settings.LIGHTNING_PROXY_PORT).start()
        try:
            return await _train(run, config, folder, GatedEngine(engine, server), server, workdir, train_ids)
        finally:
            await asyncio.to_thread(server.stop)


async def _train(run, config, folder, engine, server, workdir, train_ids) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.policy import Policy

    def load() -> tuple:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        return tokenizer, Policy(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), config)

    tokenizer, policy = await asyncio.to_thread(load)  # seconds of disk and torch: off the loop, cancel stays live
    source = HarnessSource(run, config, server, workdir, train_ids)
    evaluator = Evaluator(run, config, source)
    await evaluator.maybe(0, force=True)
    overridden = _Counter(lambda: server.app.sampling_override_calls)

    async def on_step(report: scheduler.StepReport) -> None:
        # Calls whose harness asked for other sampling parameters than the run's (the proxy used the run's).
        report.metrics["proxy/sampling_overridden_calls"] = float(overridden.delta())
        await db(services.record_step)(run.pk, report.policy_version, report.policy_version,
                                       _sample_rows(report), _drift_rows(report), report.metrics)
        await _log(run.pk, f"step {report.policy_version}/{config.steps}: reward "
                           f"{report.metrics.get('reward/mean', float('nan')):.3f}")
        await evaluator.maybe(report.policy_version, force=report.policy_version == config.steps)

    await scheduler.run(policy, engine, source, decode=tokenizer.decode, on_step=on_step,
                        checkpoint_dir=workdir / "checkpoints")
    checkpoints = sorted((workdir / "checkpoints").glob("step-*"))
    fields = {"checkpoint_path": str(checkpoints[-1])} if checkpoints else {}
    await db(services.transition_run)(run.pk, RunStatus.SUCCEEDED, **fields)
    return RunStatus.SUCCEEDED


class _Counter:
    """Differences of an ever-growing count between two reads."""

    def __init__(self, read):
        self.read, self.last = read, read()

    def delta(self) -> int:
        now = self.read()
        delta, self.last = now - self.last, now
        return delta


def _sample_rows(report: scheduler.StepReport) -> list[dict]:
    return [{"rollout_id": int(t.rollout_id), "token_ids": list(t.sample.token_ids),
             "loss_mask": list(t.sample.loss_mask), "logprobs": list(t.sample.logprobs), "advantage": t.advantage,
             "call_seqs": list(t.sample.call_seqs), "build": t.sample.build,
             "policy_version": max([v for v in t.sample.versions if v >= 0], default=0)}
            for t in report.samples]


def _drift_rows(report: scheduler.StepReport) -> dict[int, dict[int, str]]:
    return {int(rollout_id): by_seq for rollout_id, by_seq in report.drift.items() if rollout_id}


async def _watch_cancel(run_id: int, training: asyncio.Task) -> None:
    while not training.done():
        if await _cancel_requested(run_id):
            training.cancel()
            return
        await asyncio.sleep(0.5)


async def _cancel_requested(run_id: int) -> bool:
    return await db(lambda: Run.objects.filter(pk=run_id, status=RunStatus.CANCELLING).exists())()


async def _end(run_id: int, status: str, message: str) -> str:
    await db(services.transition_run)(run_id, status, error=message)
    return status


async def _log(run_id: int, line: str) -> None:
    logger.info("run %s: %s", run_id, line)
    await db(services.emit_event)(run_id, "run.log", {"line": line})
