"""Reward for the repository tasks: the fraction of the task's hidden checks that pass on the agent's repository.

Runs in the app's reward sandbox (standard library only; 10 s, 512 MB, 64 processes). The final repository is
the task's `files`, less those the outcome's `diff` deletes, overlaid with the outcome's `files` (what the harness
reports changed or added). Each check runs on it in a fresh Python process (working directory and sys.path: the
repository), all at once so that a hanging check costs CHECK_TIMEOUT_S and not the sandbox's whole budget; a check
still running then is killed with its process group. A check passes when it exits 0 after its last line: it prints
a per-call token at the end, so a module that exits early (`sys.exit(0)` on import) passes nothing.
"""
import os
import secrets
import selectors
import signal
import subprocess
import sys
import tempfile
import time

CHECK_TIMEOUT_S = 2.0
FORMAT_CREDIT = 0.1
"""Partial credit for a well-formed episode that does not pass every check: the agent ran at least one command and
none of its replies was refused as malformed (the outcome's `commands` and `format_errors`, which the
mini-SWE-agent runner reports; other harnesses report neither and get none). A task has at most 5 checks, so
the most a failing rollout scores is 0.8 + 0.1 < 1: reward 1.0, and Pass@1, still mean every check passed. Set it
to 0 for the bare fraction."""
OUTPUT_TAIL_BYTES = 4096  # what is kept of a check's stdout and stderr
ERROR_CHARS = 200
RUNNER = ("import os, sys\nsys.path.insert(0, os.getcwd())\n"
          "exec(compile({code!r}, '<check>', 'exec'), {{'__name__': '__check__'}})\n"
          "sys.stdout.write('\\n' + {token!r} + '\\n')\nsys.stdout.flush()\n")


def deleted_paths(diff):
    """Paths a git diff deletes or renames away (`deleted file mode` / `rename from` after `diff --git a/X b/X`)."""
    deleted, current = set(), None
    for line in (diff or "").splitlines():
        if line.startswith("diff --git "):
            pair = line[len("diff --git "):]
            half = (len(pair) - 1) // 2
            a, b = pair[:half], pair[half + 1:]
            current = a[2:] if a.startswith("a/") and b.startswith("b/") and a[2:] == b[2:] else None
        elif line.startswith("deleted file mode") and current:
            deleted.add(current)
        elif line.startswith("rename from "):
            deleted.add(line[len("rename from "):])
    return deleted


def final_files(task, outcome):
    """{path: text} of the repository the agent left."""
    files = dict(task.get("files") or {})
    for path in deleted_paths(outcome.get("diff")):
        files.pop(path, None)
    changed = outcome.get("files")
    if isinstance(changed, dict):
        files.update({path: text for path, text in changed.items() if isinstance(text, str)})
    return files


def write_repo(root, files):
    """Write the files under root; paths that would leave it (absolute, `..`) are skipped."""
    for rel, text in files.items():
        parts = rel.replace("\\", "/").split("/")
        if not rel or rel.startswith("/") or ".." in parts:
            continue
        path = os.path.join(root, *parts)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)


def run_checks(root, checks, timeout_s=CHECK_TIMEOUT_S):
    """[(passed, error line)] per check, all run at once; the slow ones are killed at the deadline."""
    token = secrets.token_hex(8)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": root, "TMPDIR": root, "PYTHONHASHSEED": "0",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}
    procs, tails = [], []
    with selectors.DefaultSelector() as selector:
        for index, check in enumerate(checks):
            code = RUNNER.format(code=str(check.get("code", "")), token=token)
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-B", "-c", code], cwd=root, env=env,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)
            procs.append(proc)
            tails.append({"out": b"", "err": b""})
            for name, stream in (("out", proc.stdout), ("err", proc.stderr)):
                selector.register(stream, selectors.EVENT_READ, (index, name))
        deadline = time.monotonic() + timeout_s
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for key, _ in selector.select(timeout=remaining):
                chunk = os.read(key.fd, 65536)
                index, name = key.data
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                tails[index][name] = (tails[index][name] + chunk)[-OUTPUT_TAIL_BYTES:]
    results = []
    for proc, tail in zip(procs, tails):
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever the check started goes too
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        for stream in (proc.stdout, proc.stderr):
            stream.close()
        if timed_out:
            results.append((False, f"timed out after {timeout_s:g} s"))
        elif proc.returncode == 0 and token in tail["out"].decode("utf-8", "replace"):
            results.append((True, ""))
        elif proc.returncode == 0:
            results.append((False, "the check ended before its last line (something exited early)"))
        else:
            results.append((False, _error_line(tail["err"], proc.returncode)))
    return results


def _error_line(stderr, returncode):
    """The exception line of a traceback (its last line), or the exit status when there is none."""
    lines = [line.strip() for line in stderr.decode("utf-8", "replace").splitlines() if line.strip()]
    if lines:
        return lines[-1][:ERROR_CHARS]
    return f"killed by signal {-returncode}" if returncode < 0 else f"exit code {returncode}"


def reward(task, outcome):
    """Fraction of the task's checks that pass; the detail names each check with pass or fail and its error."""
    checks = [check for check in (task.get("tests") or []) if isinstance(check, dict)]
    if not isinstance(outcome, dict):
        return {"reward": 0.0, "error": "no outcome", "checks_passed": 0, "checks_total": len(checks)}
    if not checks:
        return {"reward": 0.0, "error": "the task has no checks", "checks_passed": 0, "checks_total": 0}
    with tempfile.TemporaryDirectory(prefix="repo-") as root:
        write_repo(root, final_files(task, outcome))
        results = run_checks(root, checks)
    detail = {}
    for index, (check, (passed, error)) in enumerate(zip(checks, results)):
        name = str(check.get("name") or f"check {index + 1}")
        detail[name] = "pass" if passed else f"fail: {error}"
    passed = sum(ok for ok, _ in results)
    fraction = passed / len(checks)
    credit = FORMAT_CREDIT if passed < len(checks) and well_formed(outcome) else 0.0
    return {"reward": fraction + credit, **detail, "checks_passed": passed,
            "checks_total": len(checks), "format_credit": credit}


def well_formed(outcome):
    """The agent ran a command and none of its replies was a format error (as its runner counted them)."""
    commands, errors = outcome.get("commands"), outcome.get("format_errors")
    return isinstance(commands, int) and isinstance(errors, int) and commands >= 1 and errors == 0
