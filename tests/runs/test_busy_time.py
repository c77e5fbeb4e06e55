"""BusyTime: the wall time behind a step's time/score counts overlapping scores once."""
from runs import harness_source
from runs.harness_source import BusyTime


def test_overlapping_operations_count_once_and_an_open_one_counts_so_far(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(harness_source.time, "perf_counter", lambda: now[0])
    busy = BusyTime()
    with busy.track():
        now[0] = 101.0
        with busy.track():  # overlaps the first: adds nothing on its own
            now[0] = 103.0
        now[0] = 104.0
    assert busy.seconds == 4.0
    now[0] = 110.0  # idle time is not counted
    with busy.track():
        now[0] = 111.5
        assert busy.seconds == 5.5
    assert busy.seconds == 5.5
