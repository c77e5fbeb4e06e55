"""Migration 0013: a rollout's old trained_step (its batch's step, trained or dropped) becomes batch_step, and
trained_step stays only where its step trained on it."""
from __future__ import annotations

import pytest

from runs.models import Rollout
from tests.catalog.test_move_migration import _migrate

BEFORE = [("runs", "0012_rollout_flags_rollout_outcome")]


@pytest.mark.django_db(transaction=True)
def test_dropped_rollouts_keep_their_step_as_batch_step_and_lose_their_trained_step():
    old = _migrate(BEFORE).loader.project_state(BEFORE).apps
    user = old.get_model("auth", "User").objects.create(username="ada")
    run = old.get_model("runs", "Run").objects.create(owner=user, name="r", model="tiny", config={})
    make = old.get_model("runs", "Rollout").objects.create
    trained = make(run=run, step=0, trained_step=1, drop_reason="")
    dropped = make(run=run, step=0, group=1, trained_step=1, drop_reason="no_signal: every attempt scored 1")
    waiting = make(run=run, step=1, group=2)

    _migrate(None)

    rows = {r.pk: (r.batch_step, r.trained_step, r.drop_reason) for r in Rollout.objects.filter(run_id=run.pk)}
    assert rows == {trained.pk: (1, 1, ""), dropped.pk: (1, None, "no_signal: every attempt scored 1"),
                    waiting.pk: (None, None, "")}

    back = _migrate(BEFORE).loader.project_state(BEFORE).apps  # and back: trained_step as it was
    assert dict(back.get_model("runs", "Rollout").objects.filter(run_id=run.pk).values_list("pk", "trained_step")) == {
        trained.pk: 1, dropped.pk: 1, waiting.pk: None}
    _migrate(None)
