"""Does a real agent learn? A harness template's preset run on the repository task suite, started through the REST
API on a fresh data dir, judged by held-out Pass@1.

    flock /tmp/lw-heavy.lock .venv/bin/python bench/harness_learning.py --harness mini-swe-agent-text
    flock /tmp/lw-heavy.lock .venv/bin/python bench/harness_learning.py --harness opencode-chat --steps 5

What a user does: `manage.py up` on a fresh data dir (SQLite, embedded Redis, first user; the harness templates,
the repository suite examples/repo_tasks as dataset `repo-tasks` and its reward script `repo-checks` loaded for
that user), the template's model imported offline (`manage.py models gemma3` when the preset names Gemma 3 270M),
then the template's preset (the "preset" of examples/harnesses/<agent>/<slug>.harness.json: model, dataset,
reward script and TrainerConfig) created with POST /api/v1/runs/. The run evaluates val Pass@1 (mean of
`eval_samples` attempts per task, at the rollout temperature) before its first step and after its last; the val
tasks use templates (wording, scenario) that no train task uses, so a gain is a gain on tasks never trained on.

The agent is the real one (scripts/install-harnesses: `./lw harnesses mini-swe-agent opencode`), in bubblewrap,
calling the run's proxy; nothing about it is simulated.

It prints the curve, where the time went, exports the run page's chart as a PNG, and last:
RESULT harness=<slug> pass1_start=<x> pass1_end=<y> gain_points=<z> minutes=<m> steps=<n>
       drift_clean=<fraction of later calls merged clean> infra_failures=<n> step_s_median=<s> (then more figures)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from demo_learning import FINISHED, Api, App, curve, follow, print_curve, try_export_png  # noqa: E402

TEMPLATES = REPO / "examples" / "harnesses"
IMPORTS = {"gemma3-270m": "gemma3", "smollm2-135m-instruct": "smollm2"}
"""Preset model -> the `manage.py models` action that imports it offline."""


def template(slug: str) -> dict:
    for path in sorted(TEMPLATES.glob("*/*.harness.json")):
        raw = json.loads(path.read_text())
        if raw["slug"] == slug:
            if not raw.get("preset"):
                raise SystemExit(f"template {slug!r} ({path}) has no preset")
            return raw
    raise SystemExit(f"no harness template {slug!r} in {TEMPLATES}")


def ensure_model(name: str, data_dir: Path, models_dir: Path | None) -> None:
    """Import the preset's model into the registry the app will use, unless it is there."""
    root = models_dir or data_dir / "models"
    if (root / name / "lightning_model.json").is_file():
        return
    if name not in IMPORTS:
        raise SystemExit(f"model {name!r} is not in {root} and the bench does not know how to import it")
    env = {"LIGHTNING_DATA_DIR": str(data_dir)}
    if models_dir:
        env["LIGHTNING_MODELS_DIR"] = str(models_dir)
    print(f"importing {name} (manage.py models {IMPORTS[name]}) ...", flush=True)
    subprocess.run([sys.executable, "manage.py", "models", IMPORTS[name]], cwd=REPO, check=True,
                   env={**os.environ, **env})


def summed(points, name: str) -> float:
    return sum(v.get(name, 0.0) for _, _, v in points)


def drift_clean(points) -> float:
    """Of the trained calls that continue an earlier call's context, the fraction merged clean (token for token)
    rather than realigned. A fork (a new context: OpenCode's title request, a compaction, a reply the agent
    dropped) is not a merge and is counted apart (`forks`); a rollout's first call has nothing to extend."""
    clean, realign = summed(points, "drift/clean_count"), summed(points, "drift/realign_count")
    return clean / (clean + realign) if clean + realign else float("nan")


def time_split(points) -> str:
    """Median seconds per step of each part (generate, train, sync, ...) and of the evaluations."""
    parts = ("generate", "train", "sync", "build_samples", "checkpoint", "record", "idle")
    steps = [v for _, _, v in points if "time/step" in v]
    if not steps:
        return "no step finished"

    def median(name):
        values = sorted(v.get(name, 0.0) for v in steps)
        return values[len(values) // 2]

    evals = [v["eval/seconds"] for _, _, v in points if "eval/seconds" in v]
    return (", ".join(f"{p} {median(f'time/{p}'):.1f} s" for p in parts) + f"; step {median('time/step'):.1f} s; "
            f"evaluations {', '.join(f'{s:.0f} s' for s in evals)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--harness", required=True, help="a harness template's slug, e.g. mini-swe-agent-text")
    parser.add_argument("--steps", type=int, help="steps to train (default: the preset's)")
    parser.add_argument("--eval-tasks", type=int, help="val tasks per evaluation (default: the preset's)")
    parser.add_argument("--minutes", type=float, default=60.0, help="the budget the RESULT is judged against")
    parser.add_argument("--data-dir", type=Path, help="a fresh data dir (default: a new temporary one, removed after)")
    parser.add_argument("--models-dir", type=Path, help="a models registry to reuse (default: the data dir's own)")
    parser.add_argument("--png", type=Path, help="where the chart goes (default: docs/harness-<slug>-curve.png)")
    parser.add_argument("--no-png", action="store_true", help="do not export the chart")
    parser.add_argument("--report", type=int, metavar="RUN_ID",
                        help="no new run: report run RUN_ID of the bench whose --data-dir is given (one that stopped "
                             "before its RESULT), its click taken as the run's creation")
    args = parser.parse_args()

    raw = template(args.harness)
    preset = raw["preset"]
    config = {**preset["config"], "extra": {"preset": args.harness}}  # as the new-run form tags it (runs.presets)
    if args.steps is not None:
        config["steps"] = args.steps
    if args.eval_tasks is not None:
        config["eval_tasks"] = args.eval_tasks
    tools = REPO / "data" / "harness-tools"
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="lw-harness-bench-"))
    data_dir.mkdir(parents=True, exist_ok=True)
    if args.report is not None and not (args.data_dir and any(data_dir.glob("db.sqlite3"))):
        raise SystemExit("--report needs the --data-dir of the bench that ran it")
    if args.report is None and any(data_dir.glob("db.sqlite3")):
        raise SystemExit(f"{data_dir} is not fresh (it holds a database); give a new --data-dir")
    ensure_model(preset["model"], data_dir, args.models_dir)
    # The installed agents (./lw harnesses) are shared with the fresh data dir, as a user's tools folder is.
    app = App(data_dir, args.models_dir, {"LIGHTNING_HARNESS_TOOLS_DIR": str(tools)})
    status, points = {"status": "not started"}, []
    try:
        print(f"starting the app on {data_dir} (migrate, first user, templates, repository suite) ...", flush=True)
        app.start()
        token = Api(app.url).call("auth/token/", form={"username": "admin", "password": app.password()})["token"]
        api = Api(app.url, token)
        if args.report is not None:
            run = api.call(f"runs/{args.report}/")
            clicked, config = datetime.fromisoformat(run["created_at"]).timestamp(), run["config"]
        else:
            run, clicked = api.start_run(f"{args.harness} on {preset['dataset']}", preset["model"], config,
                                         args.harness, preset["dataset"], preset["reward_script"])
        print(f"run {run['id']}: {config['steps']} steps of {config['tasks_per_step']}x{config['group_size']} with "
              f"{args.harness} and {preset['model']}, evaluations of {config['eval_tasks']} val tasks x "
              f"{config.get('eval_samples', 1)}", flush=True)
        events = (api.every(f"runs/{run['id']}/events/?after=0") if args.report is not None
                  else follow(api, run["id"], clicked, config["steps"]))
        status = api.call(f"runs/{run['id']}/")
        print(f"host: {status.get('host', {}).get('summary', 'not recorded')}")
        points, _ = curve(events, clicked)
        print_curve(points)
        print(f"time: {time_split(points)}")
        if status["status"] != "succeeded":
            print(f"run {run['id']} {status['status']}: {status.get('error', '')}\n{app.tail()}")
        if not args.no_png:
            try_export_png(app.url, app.password(), run["id"],
                           args.png or REPO / "docs" / f"harness-{args.harness}-curve.png")
    finally:
        app.stop()
        if args.data_dir is None and status.get("status") in FINISHED:
            shutil.rmtree(data_dir, ignore_errors=True)
        elif args.data_dir is None:
            print(f"kept {data_dir} (the bench stopped before the run ended): its database and logs")
    evals = [(m, v) for m, _, v in points if "eval/pass@1" in v]
    steps_done = [v["time/step"] for _, _, v in points if "time/step" in v]
    step_s = sorted(steps_done)[len(steps_done) // 2] if steps_done else float("nan")
    common = (f"harness={args.harness} steps={len(steps_done)} drift_clean={drift_clean(points):.3f} "
              f"merges={summed(points, 'drift/clean_count') + summed(points, 'drift/realign_count'):.0f} "
              f"forks={summed(points, 'drift/fork_count'):.0f} "
              f"infra_failures={summed(points, 'rollout/infra_failures'):.0f} step_s_median={step_s:.1f}")
    if len(evals) < 2:
        print(f"RESULT {common} status={status['status']} (fewer than two evaluations: no gain to report)")
        raise SystemExit(1)
    (_, first), (end_minutes, last) = evals[0], evals[-1]
    print(f"RESULT harness={args.harness} pass1_start={first['eval/pass@1']:.3f} pass1_end={last['eval/pass@1']:.3f} "
          f"gain_points={100 * (last['eval/pass@1'] - first['eval/pass@1']):.1f} minutes={end_minutes:.1f} "
          f"{common.split(' ', 1)[1]} budget_minutes={args.minutes:g} model={preset['model']} "
          f"train_reward_first={next((v['reward/mean'] for _, _, v in points if 'reward/mean' in v), float('nan')):.3f} "
          f"status={status['status']}")


if __name__ == "__main__":
    main()
