"""What every harness template does around its agent (standard library only: it runs with any Python 3.11+).

A template's runner (examples/harnesses/<name>/run.py) is started by the executor with the rollout's placeholders:

    python run.py --task {task_file} --out {output_file} --workdir {workdir}
                  --base-url {base_url} --api-key={api_key} --model {model} [--mode M]

(`--api-key=` joined: a rollout key may begin with "-", which argparse would take for an option.)

and does the same five things for every agent:
1. reads the task: `prompt` (or `instruction`, `problem_statement`, `question`) is what the agent is asked; `files`
   ({relative path: text}) is the repository it starts from;
2. makes `<workdir>/repo`, a git repository holding those files in one commit, where the agent works;
3. gives the agent private HOME, XDG and config folders under `<workdir>/state` and no network beyond the proxy
   (telemetry, update checks and marketplaces off: each runner sets its agent's switches);
4. runs the agent non-interactively (standard input closed) under a time limit;
5. writes the outcome the reward script receives: `final_message` (the agent's last answer), `diff` (git diff of
   everything the agent changed, new files included), `files` ({path: text} of the files changed or added, up to
   1 MB in all), `exit_code`, `timed_out`, and `stderr_tail`.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROMPT_FIELDS = ("prompt", "instruction", "problem_statement", "question")
FILES_LIMIT_BYTES = 1_000_000
TAIL_CHARS = 4_000
GIT_ENV = {"GIT_AUTHOR_NAME": "task", "GIT_AUTHOR_EMAIL": "task@localhost", "GIT_COMMITTER_NAME": "task",
           "GIT_COMMITTER_EMAIL": "task@localhost", "GIT_CONFIG_NOSYSTEM": "1"}


@dataclass(frozen=True)
class Args:
    task: dict[str, Any]
    out: Path
    workdir: Path
    base_url: str  # OpenAI style, ends in /v1
    api_key: str
    model: str
    mode: str
    timeout_s: float
    options: dict[str, Any]
    """The runner's own options (parse_args's `extra`), by destination name."""

    @property
    def root_url(self) -> str:
        """The base URL without /v1 (what Anthropic clients take)."""
        return self.base_url.rstrip("/").removesuffix("/v1")


def parse_args(modes: tuple[str, ...] = ("default",), argv: list[str] | None = None,
               extra: dict[str, dict[str, Any]] | None = None) -> Args:
    """The placeholders every runner takes, plus `extra` ({"--flag": argparse keyword arguments}) of its own."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--workdir", required=True, type=Path)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--mode", default=modes[0], choices=modes)
    parser.add_argument("--timeout", type=float, default=float(os.environ.get("LIGHTNING_AGENT_TIMEOUT_S", 540)),
                        help="seconds the agent may run (keep it under the harness timeout)")
    for flag, kwargs in (extra or {}).items():
        parser.add_argument(flag, **kwargs)
    ns = parser.parse_args(argv)
    own = {action.dest for action in parser._actions if action.option_strings and
           any(flag in action.option_strings for flag in (extra or {}))}
    return Args(json.loads(ns.task.read_text()), ns.out, ns.workdir.resolve(), ns.base_url, ns.api_key, ns.model,
                ns.mode, ns.timeout, {dest: getattr(ns, dest) for dest in own})


def prompt_of(task: dict[str, Any]) -> str:
    for name in PROMPT_FIELDS:
        if isinstance(task.get(name), str) and task[name].strip():
            return task[name]
    raise SystemExit(f"the task has none of the prompt fields {', '.join(PROMPT_FIELDS)}")


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, **GIT_ENV, "HOME": str(repo.parent)}
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout


def prepare_repo(workdir: Path, task: dict[str, Any]) -> Path:
    """<workdir>/repo: a git repository with the task's files committed (an empty commit when it has none)."""
    repo = workdir / "repo"
    repo.mkdir(parents=True, exist_ok=True)
    for rel, text in (task.get("files") or {}).items():
        path = (repo / rel).resolve()
        if repo.resolve() not in path.parents:
            raise SystemExit(f"task file {rel!r} lies outside the repository")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "--allow-empty", "-m", "task")
    return repo


def private_env(workdir: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The agent's environment: PATH and locale from ours, everything else private to this rollout."""
    state = workdir / "state"
    dirs = {"HOME": state / "home", "XDG_CONFIG_HOME": state / "config", "XDG_DATA_HOME": state / "data",
            "XDG_STATE_HOME": state / "state", "XDG_CACHE_HOME": state / "cache", "TMPDIR": state / "tmp"}
    for path in dirs.values():
        path.mkdir(parents=True, exist_ok=True)
    env = {key: os.environ[key] for key in ("PATH", "LANG", "LC_ALL", "TZ", "TERM") if key in os.environ}
    env.update({key: str(path) for key, path in dirs.items()})
    env.update(GIT_ENV)
    env.update({"NO_COLOR": "1", "CI": "1", "DO_NOT_TRACK": "1"})
    env.update(extra or {})
    return env


def tools_dir() -> Path:
    """Where scripts/install-harnesses put the agents (the template passes it as LIGHTNING_HARNESS_TOOLS_DIR)."""
    return Path(os.environ.get("LIGHTNING_HARNESS_TOOLS_DIR", "")).expanduser()


def tool(*parts: str) -> Path:
    """A path inside the tools folder that must exist, or a clear exit naming the install command."""
    path = tools_dir().joinpath(*parts)
    if not path.exists():
        raise SystemExit(f"{path} is missing: run scripts/install-harnesses (LIGHTNING_HARNESS_TOOLS_DIR="
                         f"{tools_dir() or 'unset'})")
    return path


@dataclass
class Finished:
    exit_code: int | None
    timed_out: bool
    stdout: str
    stderr: str


def run_agent(argv: list[str], cwd: Path, env: dict[str, str], timeout_s: float, stdin_text: str | None = None
              ) -> Finished:
    """Run the agent in its own process group; on timeout the whole group is killed."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.PIPE if stdin_text is not None
                            else subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(stdin_text, timeout=timeout_s)
        return Finished(proc.returncode, False, stdout, stderr)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return Finished(None, True, stdout, stderr)


def changes(repo: Path) -> tuple[str, dict[str, str]]:
    """(git diff of the working tree against the task commit, new files included; {path: text} changed)."""
    _git(repo, "add", "-A")
    # --no-renames: a moved file is a deletion plus an addition, so its new text is among the changed files.
    diff = _git(repo, "diff", "--cached", "--no-color", "--no-ext-diff", "--no-renames", "HEAD")
    files: dict[str, str] = {}
    budget = FILES_LIMIT_BYTES
    for rel in _git(repo, "diff", "--cached", "--name-only", "--no-renames", "--diff-filter=AM", "HEAD").splitlines():
        path = repo / rel
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError):
            continue
        if len(text) > budget:
            break
        files[rel], budget = text, budget - len(text)
    return diff, files


def write_outcome(args: Args, repo: Path, finished: Finished, final_message: str, **extra: Any) -> dict[str, Any]:
    diff, files = changes(repo)
    outcome = {"final_message": final_message, "diff": diff, "files": files, "exit_code": finished.exit_code,
               "timed_out": finished.timed_out, "stderr_tail": finished.stderr[-TAIL_CHARS:], **extra}
    args.out.write_text(json.dumps(outcome))
    return outcome


def finish(outcome: dict[str, Any], finished: Finished) -> None:
    """Echo the agent's output tails for the rollout page, then exit with the agent's status."""
    sys.stdout.write(finished.stdout[-TAIL_CHARS:])
    sys.stderr.write(finished.stderr[-TAIL_CHARS:])
    sys.exit(0 if finished.exit_code == 0 else (124 if finished.timed_out else (finished.exit_code or 1)))
