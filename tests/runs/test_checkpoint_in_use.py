"""A checkpoint another run uses as its model stays while that run exists (issue 40.5): deleting its run is refused
with a message naming the run that uses it, pruning spares it, and a checkpoint without a tokenizer is refused
before the engine starts."""
import json
import shutil

import pytest

from common.errors import InUse
from runs import durability, services
from runs.models import Run
from runs.orchestrator import RunSetupError, model_folder

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def runs_dir(tmp_path, settings):
    settings.LIGHTNING_RUNS_DIR = tmp_path / "runs"
    settings.LIGHTNING_ENGINE_CACHE_DIR = tmp_path / "engine-cache"
    settings.LIGHTNING_CHECKPOINTS_KEPT = 1
    return settings.LIGHTNING_RUNS_DIR


def checkpoint(runs_dir, run, step, tokenizer=True):
    """A complete checkpoint folder of `run` that the registry reads as a model (config, weights, tokenizer)."""
    path = runs_dir / f"run-{run.pk}" / "checkpoints" / f"step-{step:06d}"
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (path / "model.safetensors").write_bytes(b"")
    (path / "trainer_state.json").write_text(json.dumps({"step": step}))
    if tokenizer:
        (path / "tokenizer.json").write_text("{}")
    return path


def finished(run, checkpoint_path):
    Run.objects.filter(pk=run.pk).update(status="succeeded", checkpoint_path=str(checkpoint_path))
    return Run.objects.get(pk=run.pk)


def started_from(source, path, name):
    """A run of `source`'s owner whose model is the checkpoint `path`."""
    return services.create_run(source.owner, name=name, model=str(path), config={}, harness=source.harness,
                               dataset=source.dataset, reward_script=source.reward_script)


def test_deleting_a_run_whose_checkpoint_is_another_runs_model_is_refused_naming_that_run(
        alice, alice_api, make_run, runs_dir, django_capture_on_commit_callbacks):
    source = make_run(alice, name="trained")
    path = checkpoint(runs_dir, source, 2)
    source = finished(source, path)
    user = started_from(source, path, "from-step-2")

    with django_capture_on_commit_callbacks(execute=True):
        response = alice_api.delete(f"/api/v1/runs/{source.pk}/")
    assert response.status_code == 409
    assert response.json() == {"error": {"status": 409, "code": "in_use", "message": (
        f"run {source.pk} cannot be deleted: its checkpoint step-000002 is the model of run #{user.pk} "
        "'from-step-2'; delete that run first")}}
    assert Run.objects.filter(pk=source.pk).exists() and (path / "model.safetensors").is_file()

    Run.objects.filter(pk=user.pk).update(status="failed")  # once the run that used it is gone, it goes
    with django_capture_on_commit_callbacks(execute=True):
        assert alice_api.delete(f"/api/v1/runs/{user.pk}/").status_code == 204
        assert alice_api.delete(f"/api/v1/runs/{source.pk}/").status_code == 204
    assert not Run.objects.filter(pk__in=[source.pk, user.pk]).exists()
    assert not (runs_dir / f"run-{source.pk}").exists()


def test_the_refusal_names_every_run_that_uses_one_of_its_checkpoints(alice, make_run, runs_dir):
    source = make_run(alice, name="trained")
    first, second = checkpoint(runs_dir, source, 1), checkpoint(runs_dir, source, 2)
    source = finished(source, second)
    users = [started_from(source, first, "a"), started_from(source, second, "b")]
    unrelated = make_run(alice, name="registry")  # the registry's model: no part of it
    with pytest.raises(InUse) as refused:
        services.delete_run(source, alice)
    assert str(refused.value) == (
        f"run {source.pk} cannot be deleted: its checkpoints step-000001, step-000002 are the models of runs "
        f"#{users[0].pk} 'a', #{users[1].pk} 'b'; delete those runs first")
    assert Run.objects.filter(pk__in=[source.pk, unrelated.pk]).count() == 2


def test_pruning_spares_a_checkpoint_another_run_uses_as_its_model(alice, make_run, runs_dir):
    source = make_run(alice, name="trained")
    paths = [checkpoint(runs_dir, source, step) for step in (1, 2, 3)]
    finished(source, paths[-1])
    started_from(source, paths[0], "from-step-1")
    deleted = durability.prune_checkpoints(paths[0].parent)  # LIGHTNING_CHECKPOINTS_KEPT = 1
    assert deleted == [paths[1]]
    assert sorted(p.name for p in paths[0].parent.iterdir()) == ["step-000001", "step-000003"]


def test_a_checkpoint_without_a_tokenizer_is_refused_before_the_engine_starts(alice, make_run, runs_dir):
    source = make_run(alice, name="trained")
    path = checkpoint(runs_dir, source, 2, tokenizer=False)  # written before checkpoints carried one
    user = started_from(finished(source, path), path, "from-an-old-checkpoint")
    with pytest.raises(RunSetupError) as refused:
        model_folder(user)
    assert str(refused.value) == f"model folder {path} holds no tokenizer: copy its base model's tokenizer files in"
    shutil.copy2(path / "config.json", path / "tokenizer.json")  # any vocabulary file makes it loadable
    assert model_folder(user) == path
