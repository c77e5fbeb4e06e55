"""Drives one run end to end: setup, engine and proxy, the steps' phases (RunContext, RunPhases), cancel at any moment.

The parts live beside it: harness rollouts and scoring (runs.harness_source), evaluation (runs.evaluation), the
gated engine (runs.gated_engine), heartbeat and resume from a checkpoint (runs.durability), the watch on the run's
row for a cancel, a finish now or the run taken from this worker (runs.watch).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from django.db.models import Q

from catalog import registry
from health import services as health_services
from proxy.app import create_app
from proxy.server import ProxyServer
from proxy.types import UpstreamConfig
from runs import durability, rollout_services, services, watch
from runs.evaluation import Evaluator
from runs.gated_engine import GatedEngine
from runs.harness_source import HarnessSource, reward_script_bug, reward_script_counts
from runs.models import Metric, Run, RunStatus
from runs.reconnect import db  # the run's ORM calls outlive a PostgreSQL restart
from runs.recorder import DjangoRecorder, cached_directory
from sandbox import executors, isolation
from sandbox.executors import base as sandbox_base
from trainer import model_files, scheduler
from trainer.config import TrainerConfig

logger = logging.getLogger(__name__)


class RunSetupError(RuntimeError):
    """The run cannot start; the message says what to fix."""


def model_folder(run: Run) -> Path:
    """The run's model as a folder the engine and trainer can load, or RunSetupError saying why not."""
    info = run.model_info or {}
    if info.get("origin") == "external":
        raise RunSetupError(f"{run.model} is an external engine: it cannot be trained (no weight sync); "
                            "pick a model from the registry")
    if not info.get("path"):
        raise RunSetupError(f"run {run.pk} records no folder for its model {run.model!r}; clone it to resolve it again")
    try:  # the row may have been changed since create_run checked it: check again what the engine will load
        folder = registry.check_model_path(run.owner, info["path"])
    except registry.ModelNotAllowed as exc:
        raise RunSetupError(str(exc)) from exc
    if not (folder / "config.json").is_file():
        raise RunSetupError(f"model folder {folder} is gone; import the model again (`./lw manage models ...`)")
    if not any(folder.glob("*.safetensors")):
        raise RunSetupError(f"model folder {folder} holds no *.safetensors weights")
    if not model_files.has_tokenizer(folder):  # a checkpoint written before checkpoints carried the tokenizer
        raise RunSetupError(f"model folder {folder} holds no tokenizer: copy its base model's tokenizer files in")
    return folder


def checkpoint_folder(run: Run) -> Path:
    """The checkpoint a re-queued run resumes from, or RunSetupError saying why it cannot."""
    folder = Path(run.checkpoint_path)
    if not (folder / "trainer_state.json").is_file():
        raise RunSetupError(f"checkpoint folder {folder} is gone or incomplete: the run cannot resume from it; "
                            "clone the run to start again")
    return folder


def execute(run_id: int, generation: int) -> str:
    """Run a run claimed as worker `generation` to its end; returns the final status. Blocking: the Celery task
    calls it."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_execute(run_id, generation))
    # Called from a thread that already runs a loop: give the run a thread and a loop of its own.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"run-{run_id}") as pool:
        return pool.submit(asyncio.run, _execute(run_id, generation)).result()


async def _execute(run_id: int, generation: int) -> str:
    """The run as one task that a cancel stops at any moment: engine start, evaluation, rollouts or training."""
    finish = watch.Finish()
    main = asyncio.create_task(_serve_and_train(run_id, generation, finish))
    watcher = asyncio.create_task(watch.watch(run_id, generation, main, finish))
    try:
        status = await main  # the run's processes are all stopped once it returns
        return await _end(run_id, generation, status, None)
    except services.NotHeld:  # a write of the run found it taken over before the watcher did
        return await _lost(run_id, generation)
    except asyncio.CancelledError:
        if not watcher.done():
            raise
        # Every process is gone by now: the engine's and the harnesses' context managers ran on the way out.
        if watcher.result() == watch.LOST:
            return await _lost(run_id, generation)
        await db(rollout_services.cancel_unfinished_rollouts)(run_id, "cancelled with its run")
        return await _end(run_id, generation, RunStatus.CANCELLED, "cancelled by its owner")
    finally:
        watcher.cancel()


async def _lost(run_id: int, generation: int) -> str:
    status = await db(lambda: Run.objects.values_list("status", flat=True).get(pk=run_id))()
    logger.warning("run %s: this worker (generation %s) no longer holds the run (now %s); it stopped without "
                   "touching it", run_id, generation, status)
    return status


def record_isolation(run_id: int) -> str:
    """How the run's user code will be isolated (sandbox.isolation), written on the run; RunSetupError where it cannot
    be and LIGHTNING_UNSAFE_LOCAL_EXEC=1 does not allow running it unisolated."""
    try:
        text = isolation.current().describe()
    except isolation.IsolationError as exc:
        raise RunSetupError(str(exc)) from exc
    Run.objects.filter(pk=run_id).update(isolation=text)
    return text


def record_host(run_id: int, config: TrainerConfig) -> tuple[TrainerConfig, str]:
    """Detect this worker's host, resolve the config's `auto` dtypes for it (trainer.host) and write both on the
    run; returns the resolved config and the summary line. A run resumed on another host resolves again there."""
    from trainer.host import detect, summary

    profile = detect()
    resolved, formats = config.on_host(profile)
    line = f"{summary(profile, formats)} ({formats.reason})"
    Run.objects.filter(pk=run_id).update(host={**profile.to_dict(), "formats": formats.to_dict(), "summary": line})
    return resolved, line


@dataclass(frozen=True)
class RunContext:
    """What a run's steps need once its engine and proxy are up: one object instead of positional chains."""

    run: Run
    """The run's row as it stood when the steps began (rewound first where it resumes)."""
    generation: int
    """The worker start that holds the run: its writes expect it (`expect=Q(worker_starts=generation)`)."""
    config: TrainerConfig
    """The run's config with its dtypes resolved for this host (record_host)."""
    folder: Path
    """The model's folder (model_folder): the trainer loads it, the engine serves it."""
    workdir: Path
    """The run's folder on this worker: engine logs, harness work folders, checkpoints."""
    resume: durability.ResumePoint | None
    """The checkpoint a re-queued run resumes from; None for a fresh run."""
    finish: watch.Finish
    """The step the run ends at, lowered while it trains when its owner asks it to finish now."""
    engine: GatedEngine
    """The vLLM engine, gated by the proxy for weight swaps."""
    server: ProxyServer
    """The recording proxy the harnesses call (its recorder and rollout directory write the run's rows)."""
    source: HarnessSource
    """The scheduler's rollout source: the run's train tasks, run by its harness's executor and scored."""
    evaluator: Evaluator
    """eval/* on the run's val tasks."""

    @property
    def run_id(self) -> int:
        return self.run.pk

    def last_step(self) -> int:
        """The step the run ends at: its config's, or fewer once its owner asked it to finish now."""
        return self.finish.last_step(self.config.steps)


async def _serve_and_train(run_id: int, generation: int, finish: watch.Finish) -> str:
    """Check the run can start, start its engine and proxy, and train it through one RunContext."""
    run = await db(Run.objects.get)(pk=run_id)
    config = TrainerConfig.from_dict(run.config)
    folder = await db(model_folder)(run)
    train_ids = await db(lambda: list(run.dataset.tasks.filter(split="train").values_list("pk", flat=True)))() \
        if run.dataset_id else []
    if not train_ids:
        raise RunSetupError("the run's dataset is gone or has no train tasks")
    try:
        executors.for_harness(run.harness_snapshot)  # an unknown executor, or a cluster this worker cannot use
    except sandbox_base.ExecutorSetupError as exc:
        raise RunSetupError(str(exc)) from exc
    isolation_line = await db(record_isolation)(run_id)
    config, host_line = await db(record_host)(run_id, config)
    await _log(run_id, f"host: {host_line}")
    workdir = Path(settings.LIGHTNING_RUNS_DIR) / f"run-{run_id}"
    run, resume = await _resume_point(run, generation)
    await _log(run_id, f"starting the engine for {run.model} (vLLM; about a minute on CPU)")
    from trainer.engine import EngineConfig, serving_engine

    engine_config = EngineConfig(model_path=str(folder), max_model_len=config.max_model_len,
                                 kv_cache_gb=config.kv_cache_gb, seed=config.seed, dtype=config.engine_dtype,
                                 cache_dir=str(settings.LIGHTNING_ENGINE_CACHE_DIR))

    async def engine_progress(phase: str, fraction: float | None) -> None:  # at most once a second
        await db(services.set_run_phase)(run_id, f"starting the engine: {phase}", fraction)

    async with serving_engine(engine_config, workdir / "engine", on_progress=engine_progress,
                              replicas=config.engine_replicas) as engine:
        await db(services.transition_run)(run_id, RunStatus.RUNNING, expect=Q(worker_starts=generation),
                                          note={"host": host_line, "isolation": isolation_line})
        server = _start_proxy(run_id, config, engine, engine_config.served_model_name)
        try:
            gated = GatedEngine(engine, server, drain_timeout_s=settings.LIGHTNING_WEIGHT_SYNC_DRAIN_S)
            source = HarnessSource(run, config, server, workdir, train_ids)
            return await _train(RunContext(run, generation, config, folder, workdir, resume, finish, gated, server,
                                           source, Evaluator(run, config, source)))
        finally:
            await asyncio.to_thread(server.stop)


async def _resume_point(run: Run, generation: int) -> tuple[Run, durability.ResumePoint | None]:
    """A run with a checkpoint (re-queued after a lost worker, resumed or continued by its owner) rewound to it, and
    where it resumes; a fresh run as it is, and None."""
    if not run.checkpoint_path:
        return run, None
    checkpoint = checkpoint_folder(run)
    resume = await db(durability.prepare_resume)(run, checkpoint, durability.checkpoint_step(checkpoint))
    await _log(run.pk, f"resuming from the checkpoint of step {resume.step} (worker start {generation}): "
                       f"{resume.lost_rollouts} rollouts lost in all; steps {list(resume.dropped_steps)} are redone")
    return await db(Run.objects.get)(pk=run.pk), resume  # as rewound


def _start_proxy(run_id: int, config: TrainerConfig, engine, served_model: str) -> ProxyServer:
    """The recording proxy in front of the engine (every replica of it), started."""
    replicas = tuple(url + "/v1" for url in getattr(engine, "base_urls", ())) if config.engine_replicas > 1 else ()
    upstream = UpstreamConfig(base_url=engine.base_url + "/v1", replica_urls=replicas, served_model=served_model,
                              sampling=config.sampling)
    app = create_app(cached_directory(run_id, ttl_s=0.5), DjangoRecorder(), upstream,
                     policy_version=lambda: engine.version, replica_alive=getattr(engine, "replica_running", None))
    return ProxyServer(app, host=settings.LIGHTNING_PROXY_HOST, port=settings.LIGHTNING_PROXY_PORT).start()


async def _train(ctx: RunContext) -> str:
    """Load the policy, then run the steps while the engine process lives."""
    tokenizer, policy = await _load(ctx)
    try:
        return await _unless_engine_dies(getattr(ctx.engine.engine, "server", None), ctx.source,
                                         _steps(ctx, tokenizer, policy))
    finally:
        await asyncio.to_thread(policy.close)


async def _load(ctx: RunContext) -> tuple:
    """The tokenizer and the policy: seconds of disk and torch, off the loop so that a cancel stays live."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.distributed import make_policy

    cancelled = threading.Event()

    def load() -> tuple:
        tokenizer = AutoTokenizer.from_pretrained(ctx.folder)
        # world_size > 1: a DistributedPolicy, rank 0 here and ranks 1..N-1 spawned (stopped by close below).
        policy = make_policy(AutoModelForCausalLM.from_pretrained(ctx.folder, dtype=torch.float32), ctx.config)
        if cancelled.is_set():  # nobody will close it: stop its ranks now
            policy.close()
        return tokenizer, policy

    try:
        return await asyncio.to_thread(load)
    except asyncio.CancelledError:
        cancelled.set()
        raise


async def _steps(ctx: RunContext, tokenizer, policy) -> str:
    """Step 0's evaluation (or the checkpoint's weights), the steps with their phases, the last step's evaluation."""
    if ctx.resume is None:
        await ctx.evaluator.maybe(0, force=True)
    else:  # the checkpoint's step was evaluated (if due) before the checkpoint was recorded
        await durability.restore(policy, ctx.engine, ctx.resume)
        await _log(ctx.run_id, f"the engine serves the weights of step {policy.step}")
    await scheduler.run(policy, ctx.engine, ctx.source, phases=RunPhases(ctx), decode=tokenizer.decode,
                        checkpoint_dir=ctx.workdir / "checkpoints", model_dir=ctx.folder,
                        first_group_id=ctx.resume.next_group_id if ctx.resume else 0)
    if not await db(_evaluated)(ctx.run_id, policy.step):  # asked to finish after its last step's evaluation phase
        await ctx.evaluator.maybe(policy.step, force=True)
    return RunStatus.SUCCEEDED


class RunPhases(scheduler.StepPhases):
    """A run's step phases: store each step, evaluate where due (always its last step), record each checkpoint."""

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        # Calls whose harness asked for other sampling parameters than the run's (the proxy used the run's).
        self.overridden = _Counter(lambda: ctx.server.app.sampling_override_calls)
        # Train calls the proxy refused (429) while a weight update held them past its bound.
        self.refused = _Counter(lambda: ctx.server.app.gate.refusals)

    def last_step(self, configured: int) -> int:
        return self.ctx.finish.last_step(configured)

    def evaluates_at(self, version: int) -> bool:
        return self.ctx.evaluator.due(version, force=version >= self.ctx.last_step())

    async def phase(self, text: str) -> None:  # a few a step: what the run page's header says it does now
        await db(services.set_run_phase)(self.ctx.run_id, text)

    async def record(self, report: scheduler.StepReport) -> None:
        run_id = self.ctx.run_id
        report.metrics["proxy/sampling_overridden_calls"] = float(self.overridden.delta())
        report.metrics["rollout/gate_refusals"] = float(self.refused.delta())
        report.metrics.update(reward_script_counts(report.rollouts))
        await db(rollout_services.record_step)(run_id, report.policy_version, report.policy_version,
                                               _sample_rows(report), _drift_rows(report), report.metrics,
                                               _batch_rows(report), generation=self.ctx.generation)
        await _log(run_id, f"step {report.policy_version}/{self.ctx.last_step()}: reward "
                           f"{report.metrics.get('reward/mean', float('nan')):.3f}")
        bug = reward_script_bug(report.rollouts, report.policy_version)
        if bug:
            raise RunSetupError(bug)
        await health_services.in_run(health_services.check_step, run_id, report.policy_version)

    async def evaluate(self, version: int) -> None:
        await self.ctx.evaluator.maybe(version, force=version >= self.ctx.last_step())
        await health_services.in_run(health_services.check_evaluation, self.ctx.run_id, version)

    async def checkpoint(self, path: Path, step: int) -> None:
        await db(services.record_checkpoint)(self.ctx.run_id, self.ctx.generation, str(path), step)
        await db(durability.prune_checkpoints)(path.parent)  # asks which checkpoints other runs start from


def _evaluated(run_id: int, step: int) -> bool:
    return Metric.objects.filter(run_id=run_id, step=step, name__startswith="eval/").exists()


ENGINE_POLL_S = 1.0
ENGINE_DEATH_NOTICE_S = 3.0
"""How long a run whose work failed waits to see whether the engine died under it (the watchdog polls at 0.5 s)."""


class EngineDied(RuntimeError):
    """The run's vLLM process exited while the run used it; the message says how and shows its last log lines."""


async def _unless_engine_dies(server, source: HarnessSource, work) -> str:
    """Await `work` while the engine process lives. If it dies first (killed, out of memory, crashed), the work
    stops at once, the rollouts it cut off fail as infrastructure failures saying so, and EngineDied tells the
    run why, rather than every later call failing until a weight sync finds the engine gone."""
    training = asyncio.ensure_future(work)
    try:
        while not training.done():
            for index in getattr(server, "newly_dead", lambda: [])():  # engine replicas: the others go on
                await _log(source.run.pk, f"engine replica {index} died" + (
                    "; the run goes on with the replicas left" if server.running() else ""))
            if server is not None and not server.running():
                raise EngineDied(await _engine_gone(server, source, training))
            await asyncio.wait({training}, timeout=ENGINE_POLL_S)
        if not training.cancelled() and training.exception() is not None and server is not None \
                and await _dies_within(server, ENGINE_DEATH_NOTICE_S):
            raise EngineDied(await _engine_gone(server, source, training)) from training.exception()
        return training.result()
    finally:
        if not training.done():
            training.cancel()
            await asyncio.gather(training, return_exceptions=True)


async def _dies_within(server, seconds: float) -> bool:
    """Whether the engine's process is gone now or within `seconds`. The work can fail on a dead engine (a refused
    connection) before its watchdog, which polls vLLM twice a second, has noticed and exited."""
    deadline = asyncio.get_running_loop().time() + seconds
    while server.running():
        if asyncio.get_running_loop().time() >= deadline:
            return False
        await asyncio.sleep(0.1)
    return True


async def _engine_gone(server, source: HarnessSource, training: asyncio.Future) -> str:
    from trainer.engine.server import log_tail

    reason = (f"the engine (vLLM) died mid-run; the run stopped. Its last log lines ({server.log_path}):\n"
              f"{log_tail(server.log_path, 12)}")
    source.stop_reason = reason  # the attempts it cuts off fail with this reason, as infrastructure failures
    training.cancel()
    await asyncio.gather(training, return_exceptions=True)
    # Attempts whose task was cancelled before it could close its rollout (their harness is killed meanwhile).
    await db(rollout_services.fail_unfinished_rollouts)(source.run.pk, reason)
    await _log(source.run.pk, reason.splitlines()[0])
    return reason


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
             "trainer_logprobs": list(t.trainer_logprobs), "call_seqs": list(t.sample.call_seqs),
             "spans": [[s.call_seq, s.start, s.end, s.sampled] for s in t.sample.spans], "build": t.sample.build,
             "step": report.step, "policy_version": max([v for v in t.sample.versions if v >= 0], default=0)}
            for t in report.samples]


def _batch_rows(report: scheduler.StepReport) -> dict[int, str]:
    """Every rollout of the step's batch -> why it gave no trained sample ('' when it gave one)."""
    return {int(r.rollout_id): report.dropped.get(r.rollout_id, "") for r in report.rollouts if r.rollout_id}


def _drift_rows(report: scheduler.StepReport) -> dict[int, dict[int, str]]:
    return {int(rollout_id): by_seq for rollout_id, by_seq in report.drift.items() if rollout_id}


async def _end(run_id: int, generation: int, status: str, message: str | None) -> str:
    await db(services.transition_run)(run_id, status, error=message, expect=Q(worker_starts=generation))
    return status


async def _log(run_id: int, line: str) -> None:
    logger.info("run %s: %s", run_id, line)
    await db(services.emit_event)(run_id, "run.log", {"line": line})
