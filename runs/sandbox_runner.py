"""Runs inside the reward sandbox process: loads user source, calls reward(task, outcome), writes JSON.

Standalone on purpose (no Django, no project imports): it is executed by path in a scrubbed process.
argv: result_path. stdin: {"source": str, "task": obj, "outcome": obj}.
"""
import json
import math
import sys
import traceback


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


def main() -> None:
    result_path = sys.argv[1]
    payload = json.loads(sys.stdin.read())
    try:
        namespace = {"__name__": "reward_script"}
        exec(compile(payload["source"], "<reward>", "exec"), namespace)
        func = namespace.get("reward")
        if not callable(func):
            raise NameError("the script must define a function reward(task, outcome)")
        reward, detail = _check(func(payload["task"], payload["outcome"]))
        out = {"ok": True, "reward": reward, "detail": detail}
    except MemoryError:
        out = {"ok": False, "kind": "memory", "error": "MemoryError: the reward script ran out of memory"}
    except SyntaxError as exc:
        out = {"ok": False, "kind": "syntax", "error": f"SyntaxError: {exc.msg} (line {exc.lineno})"}
    except BaseException as exc:  # user code may raise anything, SystemExit included
        out = {"ok": False, "kind": "exception", "error": _user_frames(exc)}
    sys.stdout.flush()
    with open(result_path, "w") as handle:
        json.dump(out, handle)


if __name__ == "__main__":
    main()
