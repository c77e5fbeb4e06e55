"""A run whose model is a checkpoint of an earlier run, on the CPU (vLLM, real harness subprocesses, the proxy;
issue 40.5): the checkpoint carries its tokenizer, vLLM is served its trained weights (not the KL reference the
folder also holds), so the engine's step-0 logprobs are the trainer's within the usual mismatch; the earlier run
cannot be deleted while the later one uses its checkpoint."""
from pathlib import Path

import pytest
from safetensors.torch import load_file

from common.errors import InUse
from runs import services
from runs.models import Run, Sample
from runs.tasks import execute_run
from tests.runs.test_host_formats import MAX_MISMATCH
from tests.runs.test_orchestrator import pytestmark, run_of, tiny_model  # noqa: F401 (marks and fixtures)
from trainer.policy import REFERENCE_FILE

FAST = {"eval_tasks": 0, "kl_coef": 0.1, "checkpoint_every": 1}


def first_call_mismatch(run: Run) -> tuple[float, int]:
    """Mean |engine - trainer| logprob over the tokens of each sample's first call, and how many. Those are sampled
    from exactly the engine's prompt: the harness's second turn is re-tokenized (realigned), where the random tiny
    model's logprobs differ by nats in any format."""
    gaps = []
    for sample in Sample.objects.filter(rollout__run=run, step=1):
        for call_seq, start, end, sampled in sample.spans:
            if call_seq == 0 and sampled:
                gaps += [abs(sample.logprobs[t] - sample.trainer_logprobs[t]) for t in range(start, end)
                         if sample.loss_mask[t]]
    return sum(gaps) / len(gaps), len(gaps)


def test_a_run_from_a_checkpoint_serves_the_checkpoints_weights(run_of, alice, settings):  # noqa: F811
    settings.LIGHTNING_CHECKPOINTS_KEPT = 1
    first = run_of({**FAST, "tasks_per_step": 4, "group_size": 4, "learning_rate": 1e-2})
    assert execute_run.apply(args=[first.pk]).get() == "succeeded"
    first.refresh_from_db()
    checkpoint = Path(first.checkpoint_path)
    assert [p.name for p in checkpoint.parent.iterdir()] == ["step-000002"]  # step 1 pruned as usual
    trained, reference = load_file(checkpoint / "model.safetensors"), load_file(checkpoint / REFERENCE_FILE)
    embed = "model.embed_tokens.weight"
    assert (trained[embed] - reference[embed]).abs().max() > 1e-2  # serving the reference would show

    second = services.create_run(alice, name="from-a-checkpoint", model=str(checkpoint), harness=first.harness,
                                 dataset=first.dataset, reward_script=first.reward_script,
                                 config={**FAST, "steps": 1, "tasks_per_step": 2, "group_size": 2,
                                         "max_model_len": 512, "kv_cache_gb": 0.5})
    assert execute_run.apply(args=[second.pk]).get() == "succeeded", Run.objects.get(pk=second.pk).error
    second.refresh_from_db()
    assert (second.status, second.step, second.error) == ("succeeded", 1, "")
    mismatch, tokens = first_call_mismatch(second)
    assert tokens >= 4 and mismatch <= MAX_MISMATCH[second.host["formats"]["engine_dtype"]], mismatch

    with pytest.raises(InUse, match=f"is the model of run #{second.pk} 'from-a-checkpoint'"):
        services.delete_run(first, alice)
    assert (checkpoint / "model.safetensors").is_file()
