"""A small run to export: three rollouts (train with a tool call and a trained sample, train dropped, failed val)."""
from __future__ import annotations

from catalog.models import Task
from proxy.types import RecordedCall
from runs import rollout_services
from runs.models import Rollout

TOOLS = [{"type": "function", "function": {"name": "python", "parameters": {"type": "object"}}}]


def chat_call(rollout_id: int, seq: int, answer: str, tool: bool = False) -> RecordedCall:
    message = ({"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{seq}", "type": "function", "function": {"name": "python", "arguments": '{"code": "1+1"}'}}]}
        if tool else {"role": "assistant", "content": answer})
    messages = [{"role": "system", "content": "You add <b>numbers</b>."}, {"role": "user", "content": "1+1?"}]
    if seq:
        messages += [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "python", "arguments": '{"code": "1+1"}'}}]},
            {"role": "tool", "tool_call_id": "call_0", "content": "2"}]
    return RecordedCall(
        rollout_id=str(rollout_id), seq=seq, api="chat", stream=seq == 1,
        request={"model": "policy", "messages": messages, "tools": TOOLS, "temperature": 1.0},
        response={"id": f"chatcmpl-{seq}", "object": "chat.completion",
                  "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if tool else "stop"}]},
        upstream_request={}, prompt_ids=[10 + seq, 11, 12], completion_ids=[20 + seq, 21],
        logprobs=[-0.5, -0.25 - seq], finish_reason="tool_calls" if tool else "stop", status_code=200,
        latency_ms=12.5 + seq, policy_version=seq, error=None, started_at=0.0)


def seed_export_run(owner, make_run):
    """The run and its rollouts {"trained", "dropped", "failed"}, recorded through the services."""
    run = make_run(owner)
    tasks = {t.external_id: t for t in Task.objects.filter(dataset=run.dataset)}
    trained, _ = rollout_services.create_rollout(run, task=tasks["t1"], split="train", step=1, group=0, attempt=0)
    dropped, _ = rollout_services.create_rollout(run, task=tasks["t2"], split="train", step=1, group=1, attempt=0)
    failed, _ = rollout_services.create_rollout(run, task=tasks["t0"], split="val", step=2, group=0, attempt=0)
    rollout_services.record_calls([chat_call(trained.pk, 0, "", tool=True), chat_call(trained.pk, 1, "2"),
                                   chat_call(dropped.pk, 0, "3")])
    for rollout, status, reward in ((trained, "succeeded", 1.0), (dropped, "succeeded", 0.0), (failed, "failed", None)):
        rollout_services.start_rollout(rollout.pk)
        rollout_services.finish_rollout(rollout.pk, status=status, reward=reward,
                                        reward_detail={"reward": reward, "checked": True} if reward is not None else {},
                                        exit_code=0 if reward is not None else 1,
                                        error="" if reward is not None else "engine <b>died</b>",
                                        failure_kind="" if reward is not None else "infra")
    sample = {"rollout_id": trained.pk, "token_ids": [10, 11, 12, 20, 21, 30, 31], "loss_mask": [0, 0, 0, 1, 1, 0, 1],
              "logprobs": [0.0, 0.0, 0.0, -0.5, -0.25, 0.0, -1.25], "advantage": 0.75, "call_seqs": [0, 1],
              "build": "merged", "policy_version": 1, "step": 1,
              "spans": [[0, 0, 3, False], [0, 3, 5, True], [1, 5, 6, False], [1, 6, 7, True]],
              "trainer_logprobs": [None, None, None, -0.5, -0.3, None, -1.0]}
    rollout_services.record_step(run.pk, 1, 1, [sample], {trained.pk: {0: "clean", 1: "realign"}}, {},
                                 {trained.pk: "", dropped.pk: "no_sampled_tokens"})
    rows = {r.pk: r for r in Rollout.objects.filter(run=run)}
    return run, {"trained": rows[trained.pk], "dropped": rows[dropped.pk], "failed": rows[failed.pk]}
