"""Drives one run end to end: engine, proxy, harness rollouts, rewards, training steps, evaluation, cancel."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
from pathlib import Path

from asgiref.sync import sync_to_async
from django.conf import settings

from proxy.app import create_app
from proxy.server import ProxyServer
from proxy.types import UpstreamConfig
from runs import services
from runs.executor import Attempt, LocalExecutor
from runs.models import ModelCall, RolloutStatus, Run, RunStatus, Task
from runs.recorder import DjangoRecorder, cached_directory
from trainer import scheduler
from trainer.config import TrainerConfig
from trainer.samples import CallRecord

logger = logging.getLogger(__name__)
db = sync_to_async


class RunSetupError(RuntimeError):
    """The run cannot start; the message says what to fix."""


class HarnessSource:
    """The scheduler's RolloutSource: real harness subprocesses behind the proxy, scored by the reward sandbox."""

    def __init__(self, run: Run, config: TrainerConfig, server: ProxyServer, workdir: Path, train_ids: list[int]):
        self.run, self.config, self.server, self.workdir = run, config, server, workdir
        self.train_ids, self.executor = train_ids, LocalExecutor()
        self.finished: asyncio.Queue = asyncio.Queue()
        self.running: dict[int, list[asyncio.Task]] = {}
        self.policy_version = 0

    async def launch(self, group: scheduler.GroupRequest) -> None:
        task_id = random.Random(self.config.seed * 1_000_003 + group.group_id).choice(self.train_ids)
        task = await db(Task.objects.get)(pk=task_id)
        attempts = []
        for attempt in range(group.size):
            coro = self.attempt(task, "train", group.policy_version, group.group_id, attempt)
            attempts.append(asyncio.create_task(self._report(group.group_id, coro)))
        self.running[group.group_id] = attempts

    async def next_finished(self) -> scheduler.RolloutResult:
        return await self.finished.get()

    async def cancel(self, group_id: int) -> None:
        for task in self.running.pop(group_id, []):
            task.cancel()

    async def _report(self, group_id: int, coro) -> None:
        """Every launched attempt reports, even one that crashed, or its group would never complete."""
        try:
            result = await coro
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("run %s group %s: an attempt crashed", self.run.pk, group_id)
            result = scheduler.RolloutResult(group_id, "", (), 0.0, failure_kind=scheduler.INFRA_FAILURE,
                                             error=f"{type(exc).__name__}: {exc}")
        self.finished.put_nowait(result)

    async def attempt(self, task: Task, split: str, version: int, group: int, attempt: int) -> scheduler.RolloutResult:
        """One harness run: a rollout row and key, the subprocess, the reward, the recorded calls."""
        rollout, secret = await db(services.create_rollout)(self.run, task=task, split=split, step=version,
                                                            group=group, attempt=attempt)
        await db(services.start_rollout)(rollout.pk)
        harness = self.run.harness_snapshot
        try:
            out = await self.executor.run(Attempt(
                command=harness["command"], env=harness.get("env") or {}, timeout_s=harness["timeout_s"],
                workdir=self.workdir / "rollouts" / str(rollout.pk), task_id=task.external_id,
                task=self.run.harness_task(task.data),
                rollout_id=str(rollout.pk), base_url=self.server.base_url(str(rollout.pk)), api_key=secret))
        except asyncio.CancelledError:
            await db(services.finish_rollout)(rollout.pk, status=RolloutStatus.CANCELLED, reward=None,
                                              reward_detail={}, exit_code=None, error="cancelled with its run")
            raise
        calls, trouble = await db(_calls_of)(rollout.pk)
        reward, detail, reward_error = await self._score(task, out)
        kind, error = failure_of(out, reward_error, calls, trouble)
        if kind == scheduler.POLICY_FAILURE:
            detail = {**detail, "script_reward": reward}
            reward = self.config.failure_reward
        await db(services.finish_rollout)(
            rollout.pk, status=RolloutStatus.FAILED if kind else RolloutStatus.SUCCEEDED, reward=reward,
            reward_detail=detail, exit_code=out.exit_code, stdout_tail=out.stdout_tail, stderr_tail=out.stderr_tail,
            error=error, failure_kind=kind)
        return scheduler.RolloutResult(group, str(rollout.pk), calls, reward or 0.0, failure_kind=kind, error=error)

    async def _score(self, task: Task, out) -> tuple[float | None, dict, str]:
        """The reward script's reward and detail, or the reason there is none."""
        if out.error and out.exit_code is None:
            return None, {}, ""  # the harness never ran: nothing to score
        script = self.run.reward_snapshot
        result = await asyncio.to_thread(services.score_reward, script["source"], task.data, out.outcome,
                                         script["timeout_s"])
        if not result.ok:
            return None, {"reward_error": result.error, "reward_output": result.output}, f"reward: {result.error}"
        return result.reward, result.detail, ""


def failure_of(out, reward_error: str, calls: tuple[CallRecord, ...], trouble: str) -> tuple[str, str]:
    """(failure kind, error) of a finished attempt: '' when it succeeded.

    Infrastructure: the harness could not start, the reward script crashed, or the harness failed after an engine
    or proxy error answered one of its calls. Policy: the harness timed out or exited non-zero after the model had answered (what the model
    did caused it). A harness that fails before any answer tells nothing about the model: infrastructure.
    """
    if out.error and out.exit_code is None:
        return scheduler.INFRA_FAILURE, out.error
    if reward_error:
        return scheduler.INFRA_FAILURE, reward_error
    if not out.error:
        return "", ""  # engine trouble the harness recovered from (a retried call) is no failure
    if trouble:
        return scheduler.INFRA_FAILURE, f"{out.error} after {trouble}"
    if calls:
        return scheduler.POLICY_FAILURE, out.error
    return scheduler.INFRA_FAILURE, f"{out.error} before the model answered any call"


ENGINE_TROUBLE = (429, 500, 502, 503, 504)
"""Statuses of calls the engine or the proxy could not serve (a 499 is the harness hanging up: its own doing)."""


def _calls_of(rollout_id: int) -> tuple[tuple[CallRecord, ...], str]:
    """Calls the trainer may learn from (delivered, with complete token capture), and the first engine trouble."""
    rows = list(ModelCall.objects.filter(rollout_id=rollout_id).order_by("seq")
                .only("seq", "status_code", "error", "prompt_ids", "completion_ids", "logprobs", "finish_reason",
                      "policy_version"))
    trouble = next((f"engine or proxy error on call {c.seq}: {c.error or c.status_code}" for c in rows
                    if c.status_code in ENGINE_TROUBLE), "")
    calls = tuple(CallRecord(seq=c.seq, prompt_ids=tuple(c.prompt_ids), completion_ids=tuple(c.completion_ids),
                             logprobs=tuple(c.logprobs), finish_reason=c.finish_reason or "stop",
                             policy_version=c.policy_version)
                  for c in rows if c.status_code == 200 and not c.error and c.completion_ids
                  and len(c.logprobs) == len(c.completion_ids))
    return calls, trouble


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


class GatedEngine:
    """The scheduler's Engine: a weight update first closes the proxy's gate and drains it, then pauses vLLM.

    The proxy stamps a call with the version served when the gate admits it. With the gate closed during the
    swap, every call admitted before it finishes on the old weights and every call after it starts on the new
    ones, so each recorded call's version is that of the weights that produced it.
    """

    def __init__(self, engine, server: ProxyServer):
        self.engine, self.server = engine, server

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def busy_seconds(self) -> float:
        """Wall time with at least one model call in flight through the proxy: the run's generation time."""
        return self.server.app.busy_seconds

    async def pause(self) -> None:
        await asyncio.to_thread(self.server.pause)
        await self.engine.pause()

    async def update_weights(self, model, version: int) -> None:
        await self.engine.update_weights(model, version)

    async def resume(self) -> None:
        try:
            await self.engine.resume()
        finally:
            await asyncio.to_thread(self.server.resume)


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


class Evaluator:
    """eval/pass@1 on the first `eval_tasks` val tasks, one attempt each, at the policy the engine serves."""

    def __init__(self, run: Run, config: TrainerConfig, source: HarnessSource):
        self.run, self.config, self.source = run, config, source

    async def maybe(self, step: int, force: bool = False) -> None:
        every = self.config.eval_every
        if self.config.eval_tasks == 0 or not (force or (every and step % every == 0)):
            return
        tasks = await db(lambda: list(Task.objects.filter(dataset_id=self.run.dataset_id, split="val")
                                      .order_by("index")[: self.config.eval_tasks]))()
        if not tasks:
            return
        limit = asyncio.Semaphore(max(1, self.config.tasks_per_step * self.config.group_size))

        async def one(index, task):
            async with limit:
                return await self.source.attempt(task, "val", step, index, 0)

        results = await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks)))
        # An infrastructure failure says nothing about the policy: it leaves the denominator too.
        counted = [r for r in results if r.failure_kind != scheduler.INFRA_FAILURE]
        passed = [float(r.reward >= self.config.pass_threshold and not r.failed) for r in counted]
        n = max(len(counted), 1)
        await db(services.record_metrics)(self.run.pk, step, {
            "eval/pass@1": sum(passed) / n, "eval/reward_mean": sum(r.reward for r in counted) / n,
            "eval/tasks": float(len(results)), "eval/infra_failures": float(len(results) - len(counted))})


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
