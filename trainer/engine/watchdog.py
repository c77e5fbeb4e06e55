"""Leader of the engine's process group: runs vLLM and kills the whole group when the owning process dies.

Run as a script (stdlib only, any Python): `python watchdog.py OWNER_PID -- CMD...`. It is started in a new
session, so its pid is the group id; vLLM and every process vLLM spawns stay in that group. If the owner
dies (even by SIGKILL) this process is re-parented, sees it, and terminates the group: no orphan engine.
"""
import os
import signal
import subprocess
import sys
import time

POLL_S = 0.5
GRACE_S = 10.0


def _kill_group(sig: int) -> None:
    try:
        os.killpg(os.getpgrp(), sig)
    except ProcessLookupError:
        pass


def _terminate_group(child: subprocess.Popen) -> int:
    """SIGTERM the group (this process ignores it), give it GRACE_S, then SIGKILL everything."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _kill_group(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    _kill_group(signal.SIGKILL)  # also kills this process
    return 1


def main(argv: list[str]) -> int:
    owner = int(argv[0])
    cmd = argv[argv.index("--") + 1:]
    child = subprocess.Popen(cmd)
    # A SIGTERM to the group reaches vLLM directly; this process just waits for it to exit.
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)
    while True:
        code = child.poll()
        if code is not None:
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            sys.stderr.write(f"[watchdog] vLLM {how}: stopping the engine group\n")
            sys.stderr.flush()
            _kill_group(signal.SIGTERM)  # vLLM died: take its helper processes (engine core) with it
            return code
        if os.getppid() != owner:
            sys.stderr.write(f"[watchdog] owner process {owner} is gone: stopping the engine group\n")
            return _terminate_group(child)
        time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
