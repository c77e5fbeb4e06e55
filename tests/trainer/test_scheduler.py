"""Scheduler: sync steps, async admission and the staleness bound, failed rollouts, metrics, checkpoints."""
import asyncio
import threading

import pytest

from tests.trainer.inprocess import TorchEngine, tiny_qwen2
from trainer.config import TrainerConfig
from trainer.packing import pack
from trainer.policy import Policy
from trainer.samples import CallRecord, build_samples
from trainer.scheduler import GroupRequest, RolloutResult, Scheduler, StepPhases, run
from trainer.step_metrics import dropped_rollouts


class SpyEngine:
    """Engine protocol double: records the order of control calls and the versions it was given."""

    def __init__(self):
        self.version, self.events, self.paused = 0, [], False

    async def pause(self):
        self.events.append("pause")
        self.paused = True

    async def update_weights(self, model, version):
        self.events.append(f"update:{version}")
        self.version = version

    async def resume(self):
        self.events.append("resume")
        self.paused = False


class TickSource:
    """RolloutSource double on a logical clock: a rollout of group g finishes `durations(g)` ticks after launch.

    Each call to next_finished advances the clock to the earliest pending finish, so the order is exact. A rollout's
    calls go out at launch and carry the version served then; launched while the engine is paused, they wait for
    the resume and carry the version served after it (as the proxy's gate does).
    """

    def __init__(self, engine, durations=lambda g: 1, rewards=lambda g, a: float(a % 2), failed=lambda g, a: "",
                 calls=None):
        self.engine, self.durations, self.rewards, self.failed = engine, durations, rewards, failed
        self.calls = calls or (lambda g, a, v: (CallRecord(0, (1, 10 + g), (20 + a, 21), (-1.0, -1.0),
                                                           policy_version=v),))
        self.now, self.pending, self.launched, self.cancelled, self.in_flight_max = 0, [], [], [], 0

    async def launch(self, group: GroupRequest):
        self.launched.append(group)
        version = None if getattr(self.engine, "paused", False) else self.engine.version
        for a in range(group.size):
            finish = self.now + self.durations(group.group_id)
            self.pending.append((finish, len(self.launched), a, group.group_id, version))
        self.in_flight_max = max(self.in_flight_max, len({p[3] for p in self.pending}))

    async def next_finished(self):
        self.pending.sort(key=lambda p: p[:3])
        finish, _, a, g, version = self.pending.pop(0)
        self.now = max(self.now, finish)
        version = self.engine.version if version is None else version
        return RolloutResult(g, f"{g}/{a}", self.calls(g, a, version), self.rewards(g, a), self.failed(g, a))

    async def cancel(self, group_id):
        self.cancelled.append(group_id)
        self.pending = [p for p in self.pending if p[3] != group_id]


def policy(**overrides):
    config = TrainerConfig(**{"tasks_per_step": 2, "group_size": 2, "steps": 3, "learning_rate": 1e-3, "dtype": "float32",
                              **overrides})
    return Policy(tiny_qwen2(), config)


async def test_it_runs_sync_steps_generate_then_train_then_sync():
    engine = SpyEngine()
    source = TickSource(engine)
    reports = await run(policy(), engine, source)
    assert [r.step for r in reports] == [1, 2, 3]
    assert [sorted({s.rollout_id.split("/")[0] for s in r.samples}) for r in reports] == [
        ["0", "1"], ["2", "3"], ["4", "5"]]
    assert [g.policy_version for g in source.launched] == [0, 0, 1, 1, 2, 2]
    assert engine.events == ["pause", "update:1", "resume", "pause", "update:2", "resume",
                             "pause", "update:3", "resume"]
    assert all(s.staleness == 0 for r in reports for s in r.samples)
    assert source.in_flight_max == 2 and source.cancelled == []
    m = reports[0].metrics
    assert (m["reward/mean"], m["reward/std"], m["reward/pass_rate"]) == (0.5, 0.5, 0.5)
    assert [s.advantage for s in reports[0].samples] == pytest.approx([-0.70710, 0.70710] * 2, abs=1e-4)
    assert m["advantage/zero_frac"] == 0.0


async def test_it_resumes_the_engine_when_a_weight_update_fails():
    class FailingEngine(SpyEngine):
        async def update_weights(self, model, version):
            raise RuntimeError("no weight sync on an external engine")

    engine = FailingEngine()
    with pytest.raises(RuntimeError, match="no weight sync"):
        await run(policy(steps=1), engine, TickSource(engine))
    assert engine.events == ["pause", "resume"]


async def test_it_keeps_groups_in_flight_and_forces_a_slow_group_at_the_staleness_bound():
    engine = SpyEngine()
    source = TickSource(engine, durations=lambda g: 50 if g == 0 else 1)
    config = {"mode": "async", "tasks_per_step": 1, "steps": 4, "max_staleness": 1}
    reports = await run(policy(**config), engine, source)
    trained = [sorted({int(s.rollout_id.split("/")[0]) for s in r.samples}) for r in reports]
    # Group 0 is slow: step 1 trains group 1; at version 1 group 0 is overdue, so step 2 waits for it.
    assert trained == [[1], [0], [2], [3]]
    assert [s.staleness for s in reports[1].samples] == [1, 1]
    assert max(r.metrics["staleness/max"] for r in reports) == 1
    assert source.in_flight_max == 2  # (max_staleness + 1) * tasks_per_step
    assert len(source.launched) == 4 and source.cancelled == []  # never launched beyond the last step


async def test_it_cancels_groups_in_flight_when_the_run_stops_early():
    engine = SpyEngine()
    source = TickSource(engine, durations=lambda g: 1 + g)

    class Stop(StepPhases):
        async def record(self, report):
            raise RuntimeError("cancelled by the user")

    with pytest.raises(RuntimeError, match="cancelled by the user"):
        await run(policy(mode="async", tasks_per_step=1, steps=5, max_staleness=2), engine, source, phases=Stop())
    # Group 0 was trained; 1 and 2 were still running and 3 was launched during step 1's weight swap.
    assert source.cancelled == [1, 2, 3]


async def test_a_lowered_last_step_ends_the_run_after_the_step_in_progress_with_its_checkpoint(tmp_path):
    """Finish now (runs.watch.Finish): the owner lowers the step count while step 2 is generated; the loop
    trains step 2, checkpoints it as the last one, cancels the groups launched ahead and admits no more."""
    engine = SpyEngine()
    source = TickSource(engine, durations=lambda g: 1 + g)
    class Finish(StepPhases):
        steps = 100

        def last_step(self, configured):
            return min(configured, self.steps)

        async def record(self, report):
            if report.step == 1:
                self.steps = 2  # asked while step 2's groups are already in flight

    config = {"mode": "async", "tasks_per_step": 1, "steps": 100, "max_staleness": 1, "checkpoint_every": 0}
    scheduler = Scheduler(policy(**config), engine, source, phases=Finish(), checkpoint_dir=tmp_path)
    reports = await scheduler.run()
    assert [r.step for r in reports] == [1, 2]
    assert scheduler.last_step == 2 and scheduler.policy.step == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002"]  # the last step's checkpoint, for continue
    trained = {int(s.rollout_id.split("/")[0]) for r in reports for s in r.samples}
    assert trained == {0, 1}
    assert source.cancelled == [g.group_id for g in source.launched if g.group_id not in trained] != []
    assert len(source.launched) <= 4  # nothing admitted for steps past the new last one


async def test_in_sync_mode_the_next_step_starts_after_an_evaluation_and_its_time_is_apart():
    """Issue 26.10: a sync run's evaluation (its evaluate phase) never shares the engine with the next step's
    harnesses, and its minutes are time/evaluate, not time/step. Steps without one still launch during the weight
    swap."""
    engine = SpyEngine()
    source = TickSource(engine)
    launched_at_record = {}

    class Evaluating(StepPhases):
        def evaluates_at(self, version):
            return version == 1

        async def record(self, report):
            launched_at_record[report.step] = len(source.launched)

        async def evaluate(self, version):
            await asyncio.sleep(0.3)  # the evaluation
            assert len(source.launched) == 2  # nothing of step 2 started meanwhile

    reports = await run(policy(steps=3), engine, source, phases=Evaluating())
    assert launched_at_record == {1: 2, 2: 6, 3: 6}  # step 2's groups after the evaluation; step 3's in the swap
    assert [g.policy_version for g in source.launched] == [0, 0, 1, 1, 2, 2]
    step2 = reports[1].metrics
    assert step2["time/evaluate"] >= 0.3 and step2["time/step"] < 0.3 and step2["time/record"] < 0.3
    assert reports[0].metrics["time/evaluate"] == 0.0 == reports[2].metrics["time/evaluate"]


async def test_in_async_mode_an_evaluation_holds_nothing_back():
    engine = SpyEngine()
    source = TickSource(engine)
    launched_at_evaluate = {}

    class Evaluating(StepPhases):
        def evaluates_at(self, version):
            return True

        async def evaluate(self, version):
            launched_at_evaluate[version] = len(source.launched)

    await run(policy(mode="async", tasks_per_step=1, steps=3, max_staleness=1), engine, source, phases=Evaluating())
    assert launched_at_evaluate[1] == 3  # two steps of groups in flight, the third admitted during the swap


async def test_a_step_reads_generate_train_record_evaluate_checkpoint_in_its_named_phases(tmp_path):
    """Issue 27.4: evaluation is a named phase of the step, after its record; the step's checkpoint is decided,
    saved and announced last, after both (issue 40.3: a finish asked while the step records makes it the last)."""
    engine = SpyEngine()
    heard = []

    class Hearing(StepPhases):
        def evaluates_at(self, version):
            return True

        async def phase(self, text):
            heard.append(text)

        async def record(self, report):
            heard.append(("record", report.step, len(report.rollouts)))

        async def evaluate(self, version):
            heard.append(("evaluate", version, engine.version))

        async def checkpoint(self, path, step):
            heard.append(("checkpoint", step, path.name))

    await run(policy(steps=1), engine, TickSource(engine), phases=Hearing(), checkpoint_dir=tmp_path)
    assert heard == ["step 1: generating rollouts", "step 1: training on 4 rollouts",
                     "step 1: syncing weights to the engine", "step 1: recording", ("record", 1, 4),
                     ("evaluate", 1, 1), "step 1: saving a checkpoint", ("checkpoint", 1, "step-000001")]


async def test_a_last_step_above_the_configured_steps_changes_nothing():
    engine = SpyEngine()
    class Later(StepPhases):
        def last_step(self, configured):
            return 50

    reports = await Scheduler(policy(steps=2), engine, TickSource(engine), phases=Later()).run()
    assert [r.step for r in reports] == [1, 2]


async def test_infrastructure_failures_leave_both_the_loss_and_the_baseline():
    engine = SpyEngine()
    rewards = {0: 1.0, 1: 0.0, 2: 0.0}
    source = TickSource(engine, rewards=lambda g, a: rewards[a], failed=lambda g, a: "infra" if a == 2 else "")
    reports = await run(policy(steps=1, group_size=3, advantage="dr_grpo"), engine, source)
    samples = reports[0].samples
    assert [s.rollout_id for s in samples] == ["0/0", "0/1", "1/0", "1/1"]
    # Baseline over the two counted rollouts (1 and 0): 0.5. With the infra failure in it, it would be 1/3.
    assert [s.advantage for s in samples] == pytest.approx([0.5, -0.5, 0.5, -0.5])
    m = reports[0].metrics
    assert (m["rollout/infra_failures"], m["rollout/policy_failures"]) == (2.0, 0.0)
    assert m["reward/mean"] == 0.5 and m["rollout/failed_frac"] == pytest.approx(1 / 3)
    assert set(reports[0].drift) == {"0/0", "0/1", "0/2", "1/0", "1/1", "1/2"}  # still classified for the inspector
    assert reports[0].dropped == {"0/2": "infra_failure", "1/2": "infra_failure"}


async def test_the_report_says_why_rollouts_were_dropped_and_carries_the_trainers_logprobs():
    engine = SpyEngine()
    # Group 1's attempt 1 made no call that sampled anything (the engine refused its only call).
    calls = lambda g, a, v: () if (g, a) == (1, 1) else (  # noqa: E731
        CallRecord(0, (1, 10 + g), (20 + a, 21, 22), (-1.0, -1.5, -2.0), policy_version=v),)
    source = TickSource(engine, calls=calls, failed=lambda g, a: "")
    p = policy(steps=1)
    reports = await run(p, engine, source)
    assert reports[0].dropped == {"1/1": "no_sampled_tokens"}
    samples = reports[0].samples
    assert [t.rollout_id for t in samples] == ["0/0", "0/1", "1/0"]
    for t in samples:  # trained tokens only, position 0 never (nothing predicts it)
        assert [lp is not None for lp in t.trainer_logprobs] == [bool(m) and i > 0 for i, m in enumerate(t.sample.loss_mask)]
        assert all(lp < 0 for lp in t.trainer_logprobs if lp is not None)


async def test_policy_failures_are_trained_with_the_failure_reward():
    engine = SpyEngine()
    # Attempt 1 timed out after the model answered; its reward script said 1.0, but a failure earns failure_reward.
    source = TickSource(engine, rewards=lambda g, a: 1.0, failed=lambda g, a: "policy" if a == 1 else "")
    reports = await run(policy(steps=1, advantage="dr_grpo", failure_reward=-1.0), engine, source)
    samples = reports[0].samples
    assert [s.rollout_id for s in samples] == ["0/0", "0/1", "1/0", "1/1"]
    assert [s.advantage for s in samples] == pytest.approx([1.0, -1.0, 1.0, -1.0])
    m = reports[0].metrics
    assert (m["rollout/policy_failures"], m["rollout/infra_failures"]) == (2.0, 0.0)
    assert m["reward/mean"] == 0.0


def test_a_rollout_result_refuses_an_unknown_failure_kind():
    with pytest.raises(ValueError, match="failure_kind must be one of"):
        RolloutResult(0, "0/0", (), 0.0, failure_kind="maybe")


async def test_it_measures_drift_lengths_and_the_time_split():
    def calls(g, a, v):  # call 1 extends call 0 (clean), call 2 is a sub-agent (fork)
        return (CallRecord(0, (1, 2), (3,), (-1.0,), policy_version=v),
                CallRecord(1, (1, 2, 3, 4), (5, 6), (-1.0, -1.0), policy_version=v),
                CallRecord(2, (9,), (7,), (-1.0,), policy_version=v))
    engine = SpyEngine()
    reports = await run(policy(steps=1), engine, TickSource(engine, calls=calls))
    m = reports[0].metrics
    assert (m["drift/clean_rate"], m["drift/fork_rate"], m["drift/realign_rate"]) == (0.5, 0.5, 0.0)
    assert m["length/completion_tokens_mean"] == 4
    assert m["length/context_tokens_mean"] == (3 + 6 + 2) / 3  # per call: prompt + completion
    assert m["length/context_tokens_max"] == 6
    assert m["length/sample_tokens_mean"] == (6 + 2) / 2
    assert m["rollout/calls_mean"] == 3
    assert m["train/samples"] == 8
    parts = ("generate", "train", "sync", "build_samples", "checkpoint", "record", "idle")
    split = sum(m[f"time/{part}"] for part in parts)
    assert split == pytest.approx(m["time/step"], rel=1e-6) or split >= m["time/step"]
    assert m["time/build_samples"] > 0 and m["time/score"] == 0.0  # TickSource has no score_seconds
    assert 0 <= m["time/busy_frac"] <= 1


async def test_it_builds_samples_and_checkpoints_on_the_trainer_thread_not_the_loop(tmp_path, monkeypatch):
    threads = {}
    build, save = Scheduler._samples, Policy.save_checkpoint

    def spy_build(self, batch, dropped_groups=()):
        threads.setdefault("build", set()).add(threading.current_thread().name)
        return build(self, batch, dropped_groups)

    def spy_save(self, path):
        threads.setdefault("save", set()).add(threading.current_thread().name)
        return save(self, path)

    monkeypatch.setattr(Scheduler, "_samples", spy_build)
    monkeypatch.setattr(Policy, "save_checkpoint", spy_save)
    engine = SpyEngine()
    await Scheduler(policy(steps=2, checkpoint_every=1), engine, TickSource(engine), checkpoint_dir=tmp_path).run()
    loop_thread = threading.current_thread().name
    assert {name.split("_")[0] for name in threads["build"] | threads["save"]} == {"trainer"}
    assert loop_thread not in threads["build"] | threads["save"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001", "step-000002"]


async def test_it_counts_recording_in_the_next_step_and_reads_the_sources_score_time():
    class ScoringSource(TickSource):
        score_seconds = 0.0

        async def next_finished(self):
            self.score_seconds += 0.25  # each rollout's reward took 0.25 s
            return await super().next_finished()

    class Recording(StepPhases):
        async def record(self, report):
            await asyncio.sleep(0.05)

    engine = SpyEngine()
    reports = await run(policy(steps=2), engine, ScoringSource(engine), phases=Recording())
    first, second = reports[0].metrics, reports[1].metrics
    assert first["time/record"] == 0.0 and second["time/record"] >= 0.05  # step 1's report is stored in step 2
    assert first["time/score"] == pytest.approx(4 * 0.25) and second["time/score"] == pytest.approx(4 * 0.25)
    assert second["time/idle"] <= second["time/step"] - second["time/record"] + 1e-9


async def test_it_checkpoints_and_resumes_at_the_saved_step(tmp_path):
    engine = SpyEngine()
    first = policy(steps=2, checkpoint_every=1)
    await Scheduler(first, engine, TickSource(engine), checkpoint_dir=tmp_path).run()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001", "step-000002"]
    resumed = policy(steps=3)
    resumed.load_checkpoint(tmp_path / "step-000002")
    engine = SpyEngine()
    engine.version = resumed.version
    source = TickSource(engine)
    reports = await run(resumed, engine, source, first_group_id=40)
    assert [r.step for r in reports] == [3]
    assert [g.group_id for g in source.launched] == [40, 41]
    assert engine.events == ["pause", "update:3", "resume"]


async def test_torch_engine_holds_calls_while_paused_and_stamps_the_new_version():
    model = tiny_qwen2()
    engine = TorchEngine(model, temperature=0.7)
    await engine.pause()
    held = asyncio.create_task(engine.generate([1, 2, 3], max_new_tokens=3))
    await asyncio.sleep(0.05)
    assert not held.done()
    await engine.update_weights(model, version=7)
    await engine.resume()
    out = await held
    assert out.policy_version == 7 and len(out.completion_ids) == len(out.logprobs) == 3
    assert out.finish_reason == "length"


async def test_torch_engine_logprobs_match_the_trainers():
    model = tiny_qwen2()
    config = TrainerConfig(dtype="float32", temperature=0.7)
    engine = TorchEngine(model, temperature=0.7, seed=3)
    out = await engine.generate([1, 2, 3], max_new_tokens=6)
    calls = (CallRecord(0, (1, 2, 3), out.completion_ids, out.logprobs),)
    sample, = build_samples(calls).samples
    logp, _ = Policy(model, config).logprobs([sample])
    assert logp.tolist() == pytest.approx(list(out.logprobs), abs=1e-5)
    assert pack([sample]).behaviour.tolist() == pytest.approx(list(out.logprobs))


async def test_torch_engine_batches_concurrent_calls_with_the_trainers_logprobs():
    model = tiny_qwen2()
    engine = TorchEngine(model, temperature=0.7, seed=5)
    prompts = [[1, 2, 3, 4, 5], [6], [7, 8]]
    outs = await asyncio.gather(*(engine.generate(p, max_new_tokens=n, stop_ids=[9]) for p, n in
                                  zip(prompts, [5, 3, 4])))
    assert [len(o.completion_ids) <= n for o, n in zip(outs, [5, 3, 4])] == [True] * 3
    assert all(o.finish_reason == ("stop" if o.completion_ids[-1] == 9 else "length") for o in outs)
    samples = [build_samples([CallRecord(0, tuple(p), o.completion_ids, o.logprobs)]).samples[0]
               for p, o in zip(prompts, outs)]
    logp, _ = Policy(model, TrainerConfig(dtype="float32", temperature=0.7)).logprobs(samples)
    assert logp.tolist() == pytest.approx([lp for o in outs for lp in o.logprobs], abs=1e-5)


async def test_torch_engine_lets_a_late_call_join_a_running_batch():
    model = tiny_qwen2()
    engine = TorchEngine(model, temperature=0.7, seed=2)
    early = asyncio.create_task(engine.generate([1, 2, 3, 4, 5, 6, 7], max_new_tokens=12))
    while not engine._batch.rows:
        await asyncio.sleep(0)
    late = await engine.generate([8, 9], max_new_tokens=3)
    assert not early.done()  # the late call joined and left while the early one kept decoding
    first = await early
    samples = [build_samples([CallRecord(0, tuple(p), o.completion_ids, o.logprobs)]).samples[0]
               for p, o in (([1, 2, 3, 4, 5, 6, 7], first), ([8, 9], late))]
    logp, _ = Policy(model, TrainerConfig(dtype="float32", temperature=0.7)).logprobs(samples)
    assert logp.tolist() == pytest.approx(list(first.logprobs) + list(late.logprobs), abs=1e-5)
    assert engine._batch.rows == [] and engine.busy_seconds > 0


async def test_it_launches_the_next_groups_while_the_engine_is_paused_at_the_version_it_will_serve():
    engine = SpyEngine()

    class LoggingSource(TickSource):
        async def launch(self, group):
            engine.events.append(f"launch:{group.group_id}@{group.policy_version}")
            await super().launch(group)

    await run(policy(steps=2), engine, LoggingSource(engine))
    # Step 2's harnesses start up during step 1's weight swap; their calls wait for the resume.
    assert engine.events == ["launch:0@0", "launch:1@0", "pause", "launch:2@1", "launch:3@1", "update:1", "resume",
                             "pause", "update:2", "resume"]


def test_rollout_metrics_count_groups_with_signal_dropped_rollouts_and_drift():
    from types import SimpleNamespace

    from trainer.scheduler import TrainedSample
    from trainer.step_metrics import rollout_metrics

    def result(group, rollout, reward, kind=""):
        return RolloutResult(group, rollout, (CallRecord(0, (1,), (2,), (-0.1,)),), reward, failure_kind=kind)

    rollouts = [result(0, "a", 1.0), result(0, "b", 0.0),  # rewards differ: signal
                result(1, "c", 1.0), result(1, "d", 1.0),  # all alike: none
                result(2, "e", 0.0), result(2, "f", 1.0, "infra")]  # the infra failure does not count
    trained = [TrainedSample(r, SimpleNamespace(token_ids=[1, 2]), 0.0, 0) for r in ("a", "b", "c", "d", "e")]
    drift = {"a": {0: "clean", 1: "realign", 2: "fork"}, "b": {0: "clean", 1: "clean"}}
    m = rollout_metrics(rollouts, trained, drift, pass_threshold=1.0)
    assert (m["groups/total"], m["groups/with_signal"]) == (3.0, 1.0)
    assert (m["samples/trained"], m["samples/dropped_rollouts"]) == (5.0, 1.0)
    assert (m["drift/clean_count"], m["drift/realign_count"], m["drift/fork_count"]) == (1.0, 1.0, 1.0)


def test_dropped_rollouts_names_the_infra_error():
    failed = RolloutResult(0, "0/1", (), 0.0, "infra", error="engine refused: 503")
    assert dropped_rollouts([RolloutResult(0, "0/0", (), 1.0), failed], []) == {
        "0/0": "no_sampled_tokens", "0/1": "infra_failure: engine refused: 503"}


# ---- dynamic sampling ---------------------------------------------------------------------------------------------

def constant_for_even_groups(g, a):
    """Even groups: every attempt scores 1 (no signal); odd groups: attempts alternate 0 and 1."""
    return 1.0 if g % 2 == 0 else float(a % 2)


async def test_dynamic_sampling_drops_groups_without_signal_and_refills_the_batch():
    engine = SpyEngine()
    source = TickSource(engine, rewards=constant_for_even_groups)
    reports = await run(policy(steps=2, dynamic_sampling=True), engine, source)
    # Step 1: groups 0 and 2 had no signal and were replaced (2, then 3); step 2 likewise (4 and 6 by 5 and 7).
    assert [g.group_id for g in source.launched] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert [g.policy_version for g in source.launched] == [0, 0, 0, 0, 1, 1, 1, 1]
    first = reports[0]
    assert sorted({s.rollout_id.split("/")[0] for s in first.samples}) == ["1", "3"]
    # The dropped groups' rollouts stay in the step's report, each with why it was not trained.
    assert [r.rollout_id for r in first.rollouts] == ["1/0", "1/1", "3/0", "3/1", "0/0", "0/1", "2/0", "2/1"]
    assert first.dropped == {f"{g}/{a}": "no_signal: every attempt scored 1" for g in (0, 2) for a in (0, 1)}
    assert set(first.drift) == {r.rollout_id for r in first.rollouts}  # classified for the inspector all the same
    m = first.metrics
    assert (m["groups/sampled"], m["groups/trained"], m["groups/trained_with_signal"]) == (4.0, 2.0, 2.0)
    assert (m["groups/dropped_no_signal"], m["rollout/extra"]) == (2.0, 4.0)
    assert (m["groups/signal_share"], m["groups/sampled_signal_share"]) == (1.0, 0.5)
    assert (m["groups/total"], m["groups/with_signal"]) == (4.0, 2.0)
    assert m["reward/mean"] == 0.75  # over every rollout sampled: the policy's reward, not the kept groups'
    assert m["advantage/zero_frac"] == 0.0
    assert sorted({s.rollout_id.split("/")[0] for s in reports[1].samples}) == ["5", "7"]
    assert source.cancelled == []


async def test_without_dynamic_sampling_groups_without_signal_are_trained_as_before():
    engine = SpyEngine()
    source = TickSource(engine, rewards=constant_for_even_groups)
    reports = await run(policy(steps=1), engine, source)
    assert [g.group_id for g in source.launched] == [0, 1]
    m = reports[0].metrics
    assert reports[0].dropped == {}
    assert (m["groups/sampled"], m["groups/trained"], m["groups/trained_with_signal"]) == (2.0, 2.0, 1.0)
    assert (m["groups/signal_share"], m["groups/sampled_signal_share"], m["rollout/extra"]) == (0.5, 0.5, 0.0)


async def test_dynamic_sampling_trains_what_it_has_once_the_extra_budget_is_spent():
    engine = SpyEngine()
    source = TickSource(engine, rewards=lambda g, a: 0.0)  # no group ever has signal
    reports = await run(policy(steps=2, dynamic_sampling=True, dynamic_sampling_max_extra=1.0), engine, source)
    # tasks_per_step=2, max extra 1.0 -> 2 groups may be dropped per step: 0 and 1, then 2 and 3 are trained.
    assert [g.group_id for g in source.launched] == [0, 1, 2, 3, 4, 5, 6, 7]
    first = reports[0]
    assert sorted({s.rollout_id.split("/")[0] for s in first.samples}) == ["2", "3"]
    assert all(s.advantage == 0.0 for s in first.samples)
    assert set(first.dropped) == {"0/0", "0/1", "1/0", "1/1"}
    m = first.metrics
    assert (m["groups/sampled"], m["groups/trained_with_signal"], m["groups/dropped_no_signal"]) == (4.0, 0.0, 2.0)
    assert (m["groups/signal_share"], m["rollout/extra"]) == (0.0, 4.0)
    # The budget is per step: step 2 drops two again.
    assert reports[1].metrics["groups/dropped_no_signal"] == 2.0


@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo", "rloo"])
async def test_dynamic_sampling_keeps_only_groups_with_signal_for_every_estimator(advantage):
    engine = SpyEngine()
    source = TickSource(engine, rewards=constant_for_even_groups)
    reports = await run(policy(steps=1, dynamic_sampling=True, advantage=advantage), engine, source)
    samples = reports[0].samples
    assert sorted({s.rollout_id.split("/")[0] for s in samples}) == ["1", "3"]
    assert all(s.advantage != 0.0 for s in samples)


async def test_dynamic_sampling_counts_a_group_of_infrastructure_failures_as_without_signal():
    engine = SpyEngine()
    # Group 0: one attempt failed for infrastructure, so one reward counts: nothing to compare it with.
    source = TickSource(engine, failed=lambda g, a: "infra" if (g, a) == (0, 1) else "")
    reports = await run(policy(steps=1, dynamic_sampling=True), engine, source)
    assert reports[0].dropped == {"0/0": "no_signal: 1 of 2 attempts counted", "0/1": "infra_failure"}
    assert sorted({s.rollout_id.split("/")[0] for s in reports[0].samples}) == ["1", "2"]


async def test_dynamic_sampling_in_async_mode_keeps_the_staleness_bound():
    engine = SpyEngine()
    # Group 1 is slow and without signal, even groups have none either: replacements keep coming while the bound
    # forces slow groups into batches.
    source = TickSource(engine, durations=lambda g: 5 if g == 1 else 1,
                        rewards=lambda g, a: 1.0 if g in (0, 2, 4) else float(a % 2))
    config = {"mode": "async", "tasks_per_step": 1, "steps": 4, "max_staleness": 1, "dynamic_sampling": True}
    reports = await run(policy(**config), engine, source)
    trained = [sorted({int(s.rollout_id.split("/")[0]) for s in r.samples}) for r in reports]
    assert all(len(t) == 1 for t in trained)
    assert max(s.staleness for r in reports for s in r.samples) <= 1
    assert max(r.metrics["staleness/max"] for r in reports) <= 1
    dropped_groups = sorted({int(rid.split("/")[0]) for r in reports for rid in r.dropped})
    assert dropped_groups == [0, 2, 4]
    assert not set(dropped_groups) & {g for t in trained for g in t}
    assert all(r.metrics["groups/signal_share"] == 1.0 for r in reports)
    assert source.in_flight_max <= 2  # (max_staleness + 1) * tasks_per_step groups in flight, dropped ones gone


def test_dynamic_sampling_budget_and_counters():
    from trainer.config import ConfigError
    from trainer.scheduler import _Group
    from trainer.step_metrics import no_signal_reason

    assert TrainerConfig(tasks_per_step=4).extra_groups_per_step == 0
    assert TrainerConfig(tasks_per_step=4, dynamic_sampling=True).extra_groups_per_step == 8
    assert TrainerConfig(tasks_per_step=3, dynamic_sampling=True, dynamic_sampling_max_extra=0.5
                         ).extra_groups_per_step == 2
    with pytest.raises(ConfigError, match="dynamic_sampling_max_extra must not be negative"):
        TrainerConfig(dynamic_sampling_max_extra=-1)
    assert no_signal_reason([0.1, 0.1, 0.1], 3) == "no_signal: every attempt scored 0.1"
    assert no_signal_reason([0.0, 1.0], 2) == ""
    assert no_signal_reason([], 4) == "no_signal: 0 of 4 attempts counted"
    # A group dropped but not yet reported is untrained: a resume from a checkpoint treats its rollouts as lost.
    scheduler = Scheduler(policy(), SpyEngine(), TickSource(SpyEngine()))
    scheduler.next_group_id = 5
    scheduler.groups = {4: _Group(GroupRequest(4, 2, 0))}
    scheduler.no_signal = [_Group(GroupRequest(3, 2, 0))]
    assert scheduler.counters() == {"next_group_id": 5, "untrained_groups": [3, 4]}
