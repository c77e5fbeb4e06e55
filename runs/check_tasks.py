"""The Celery task of a harness check: claim the queued check, run runs.harness_check on it, write its report."""
from __future__ import annotations

import logging
import tempfile
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Iterator

from celery import shared_task
from django.conf import settings

from catalog.models import Executor
from common import errors as services
from runs import check_services
from runs.harness_check import check_harness
from runs.models import CheckEngine, HarnessCheck
from sandbox import executors
from sandbox.executors import base as sandbox_base

logger = logging.getLogger(__name__)


@shared_task(name="runs.check_tasks.run_harness_check", acks_late=True)
def run_harness_check(check_id: int) -> str:
    """Run one queued check to its end; returns its final status. A redelivered task finds it taken and returns."""
    claim = check_services.claim_harness_check(check_id)
    if claim is None:
        return HarnessCheck.objects.filter(pk=check_id).values_list("status", flat=True).first() or "missing"
    check = HarnessCheck.objects.select_related("harness", "reward_script").get(pk=check_id)
    try:
        report = run_check(check)
    except services.ServiceError as exc:
        logger.warning("harness check %s cannot run: %s", check_id, exc)
        check_services.finish_harness_check(check_id, claim, error=str(exc))
    except Exception as exc:
        logger.exception("harness check %s crashed", check_id)
        check_services.finish_harness_check(check_id, claim, error=f"{type(exc).__name__}: {exc}")
    else:
        check_services.finish_harness_check(check_id, claim, report=report)
    return HarnessCheck.objects.filter(pk=check_id).values_list("status", flat=True).get()


def run_check(check: HarnessCheck) -> dict:
    """The check's report: the harness run once through the proxy, against the scripted engine over the model's
    tokenizer or against the model itself on vLLM."""
    harness, script = check.harness, check.reward_script
    folder = check_services.check_tokenizer_model(check.model)
    try:
        executor = executors.for_harness({"executor": harness.executor, "image": harness.image,
                                          "resources": harness.resources})
    except sandbox_base.ExecutorSetupError as exc:
        raise services.ServiceError(f"the harness cannot run on this worker: {exc}") from None
    local = harness.executor == Executor.LOCAL  # a pod reaches the proxy where a run's pods do
    with tempfile.TemporaryDirectory(prefix=f"harness-check-{check.pk}-") as workdir:
        scripted = nullcontext((None, check.model))  # check_harness starts the scripted engine itself
        serving = vllm_engine(folder, Path(workdir)) if check.engine == CheckEngine.VLLM else scripted
        with serving as (engine_base_url, model):
            result = check_harness(
                harness.command, harness.env, harness.timeout_s, check.task, hidden=check.reward_only_fields,
                tokenizer_dir=folder, engine_base_url=engine_base_url, model=model,
                reward_source=script.source if script else None, workdir=workdir,
                read_only=(harness.resources or {}).get("read_only") or (), executor=executor,
                proxy_host="127.0.0.1" if local else settings.LIGHTNING_PROXY_HOST, check_id=str(check.pk))
    return result.report()


@contextmanager
def vllm_engine(folder: Path, workdir: Path) -> Iterator[tuple[str, str]]:
    """(base URL, served model name) of vLLM serving the model folder as a run's engine serves it."""
    from trainer.config import TrainerConfig
    from trainer.engine import EngineConfig, managed_engine

    dtype = TrainerConfig().for_this_host().engine_dtype  # `auto` on this worker's host, as a run resolves it
    config = EngineConfig(model_path=str(folder), cache_dir=str(settings.LIGHTNING_ENGINE_CACHE_DIR), dtype=dtype)
    with managed_engine(config, workdir / "engine") as engine:
        yield engine.base_url + "/v1", config.served_model_name
