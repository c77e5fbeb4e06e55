"""Runs inside the reward sandbox process: loads user source, calls reward(task, outcome), writes JSON.

Standalone on purpose (no Django, no project imports): it is executed by path in a scrubbed process (inside
bubblewrap where sandbox.isolation can use it). It sets its own limits before it reads the script from stdin, so no
user code runs without them.
argv: result_fd memory_bytes cpu_s file_bytes nproc (0: none). stdin: {"source": str, "task": obj, "outcome": obj}.
The result goes to the inherited pipe result_fd as one JSON object.

A script declares an outcome it cannot make sense of (garbage output, no answer block) by raising
`UnparseableOutcome(why)`, a name every script has without importing anything: the rollout then scores as the
policy's failure (reward 0, or the run's failure_reward), not as the script's own crash, which a run leaves out of
the loss as an infrastructure failure.
"""
import json
import math
import os
import resource
import sys
import traceback


class UnparseableOutcome(Exception):
    """Raised by a reward script: the outcome is the policy's garbage, to be scored as its failure."""


def _user_frames(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == "<reward>"]
    where = f" (line {frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _check(value):
    detail = {}
    if isinstance(value, dict):
        if "reward" not in value:
            raise TypeError("reward() returned a dict without a 'reward' key")
        detail = {k: v for k, v in value.items() if k != "reward"}
        value = value["reward"]
    if isinstance(value, bool):
        value = float(value)
    if not isinstance(value, (int, float)):
        raise TypeError(f"reward() must return a number or {{'reward': number, ...}}, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"reward() returned {value}, which is not a finite number")
    json.dumps(detail)  # detail must be JSON; raises TypeError naming the bad value
    return value, detail


def _limit(memory: int, cpu: int, file_bytes: int, nproc: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if nproc:
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))


def main() -> None:
    result_fd, memory, cpu, file_bytes, nproc = (int(arg) for arg in sys.argv[1:6])
    _limit(memory, cpu, file_bytes, nproc)
    payload = json.loads(sys.stdin.read())
    try:
        namespace = {"__name__": "reward_script", "UnparseableOutcome": UnparseableOutcome}
        exec(compile(payload["source"], "<reward>", "exec"), namespace)
        func = namespace.get("reward")
        if not callable(func):
            raise NameError("the script must define a function reward(task, outcome)")
        reward, detail = _check(func(payload["task"], payload["outcome"]))
        out = {"ok": True, "reward": reward, "detail": detail}
    except UnparseableOutcome as exc:
        out = {"ok": False, "kind": "unparseable", "error": f"UnparseableOutcome: {exc}"}
    except MemoryError:
        out = {"ok": False, "kind": "memory", "error": "MemoryError: the reward script ran out of memory"}
    except SyntaxError as exc:
        out = {"ok": False, "kind": "syntax", "error": f"SyntaxError: {exc.msg} (line {exc.lineno})"}
    except BaseException as exc:  # user code may raise anything, SystemExit included
        out = {"ok": False, "kind": "exception", "error": _user_frames(exc)}
    sys.stdout.flush()
    with os.fdopen(result_fd, "w") as handle:
        json.dump(out, handle)


if __name__ == "__main__":
    main()
