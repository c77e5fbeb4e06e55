"""Rollout.failure_kind (finish_rollout, its event, the API) and ModelCall.sampling_overrides (record_calls, API)."""
from dataclasses import dataclass, field

import pytest

from common import errors as services
from proxy.types import RecordedCall
from runs import rollout_services
from runs.models import ModelCall, Rollout, RunEvent

pytestmark = pytest.mark.django_db
URL = "/api/v1/rollouts/"


@pytest.fixture
def rollout(alice, make_run):
    run = make_run(alice)
    return rollout_services.create_rollout(run, task=None, split="train", step=0, group=0, attempt=0)[0]


@pytest.mark.parametrize("kind", ["policy", "infra", ""])
def test_finish_rollout_stores_the_failure_kind_and_sends_it(alice_api, rollout, kind):
    rollout_services.finish_rollout(rollout.pk, status="failed" if kind else "succeeded", reward=0.0, reward_detail={},
                                    exit_code=1, error="harness exited with code 1" if kind else "", failure_kind=kind)
    assert Rollout.objects.get(pk=rollout.pk).failure_kind == kind
    event = RunEvent.objects.filter(run=rollout.run, kind="rollout.status").get()
    assert event.payload["failure_kind"] == kind and event.payload["rollout"] == rollout.pk
    assert alice_api.get(f"{URL}{rollout.pk}/").json()["failure_kind"] == kind
    assert alice_api.get(URL).json()["results"][0]["failure_kind"] == kind


def test_an_unknown_failure_kind_is_refused(rollout):
    with pytest.raises(services.ServiceError, match=r"failure_kind must be one of \['', 'policy', 'infra'\], "
                                                    r"got 'oops'"):
        rollout_services.finish_rollout(rollout.pk, status="failed", reward=None, reward_detail={}, exit_code=None,
                                        failure_kind="oops")
    assert Rollout.objects.get(pk=rollout.pk).status == "pending"


@dataclass(frozen=True)
class OverriddenCall(RecordedCall):
    """A RecordedCall carrying the overrides the proxy applied (the proxy's own type gains the same field)."""

    sampling_overrides: dict = field(default_factory=dict)


def call(rollout, seq, **extra):
    cls = OverriddenCall if extra else RecordedCall
    return cls(rollout_id=str(rollout.pk), seq=seq, api="chat", request={"messages": [], "temperature": 0.2},
               response={"text": "ok"}, upstream_request={}, prompt_ids=[1], completion_ids=[2], logprobs=[-0.1],
               finish_reason="stop", status_code=200, latency_ms=1.0, policy_version=0, error=None, stream=False,
               started_at=0.0, **extra)


def test_sampling_overrides_are_stored_and_shown(alice_api, rollout):
    rollout_services.record_calls([call(rollout, 0, sampling_overrides={"temperature": {"asked": 0.2, "used": 1.0}}),
                                   call(rollout, 1, sampling_overrides={}), call(rollout, 2)])
    assert list(ModelCall.objects.filter(rollout=rollout).values_list("seq", "sampling_overrides")) == [
        (0, {"temperature": {"asked": 0.2, "used": 1.0}}), (1, {}), (2, {})]
    calls = alice_api.get(f"{URL}{rollout.pk}/").json()["calls"]
    assert [c["sampling_overrides"] for c in calls] == [{"temperature": {"asked": 0.2, "used": 1.0}}, {}, {}]
