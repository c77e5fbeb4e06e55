"""Does dynamic sampling keep the learning signal, and does that pay? Two presets, each run twice in one invocation,
with and without dynamic sampling, in the same minutes, judged by held-out Pass@1. (Issue 31 named it
bench/signal.py; that name is the standard library's `signal`, which every script in bench/ would then import
instead of the real one.)

    flock /tmp/lw-heavy.lock .venv/bin/python bench/learning_signal.py                 # demo 2 x 20 min, repo 2 x 60 min
    flock /tmp/lw-heavy.lock .venv/bin/python bench/learning_signal.py --only demo     # the demo pair alone

Each arm is what a user does (bench/demo_learning.py, bench/harness_learning.py): `manage.py up` on a fresh data
dir, the preset's model imported offline, the preset's run created with POST /api/v1/runs/, its config as the
preset has it but for `dynamic_sampling` (on or off), `eval_every` (0 by default: an evaluation at step 0 and at
the end only, so neither arm spends its minutes on more evaluations than the other) and a step count the budget
cannot reach. The bench asks the run to finish (POST runs/{id}/finish/) as soon as one more step and the final
evaluation would no longer fit the arm's minutes from the click (demo_learning.follow); the run then ends with an
evaluation at its last step, and the arm's gain is that Pass@1 minus step 0's. Both arms of a preset get the same
minutes: the arm with dynamic sampling trains fewer steps in them, since each of its steps may sample up to
dynamic_sampling_max_extra x the batch more.

The presets: the demo (examples/arith/preset.json; val wordings no train task uses) and the repository suite's
(the mini-SWE-agent template's preset, examples/repo_tasks; val templates no train task uses).

It prints each arm's curve with its signal figures per step, and last:
RESULT demo_gain_on=<pts> demo_gain_off=<pts> repo_gain_on=<pts> repo_gain_off=<pts> signal_share_on=<mean>
       signal_share_off=<mean> extra_rollouts=<fraction> (then steps and minutes per arm)
signal_share_* is the mean over the arms' steps of the share of trained groups whose attempts scored differently;
extra_rollouts is the rollouts dynamic sampling spent on dropped groups over the rollouts it trained.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from demo_learning import PRESET, Api, App, curve, follow  # noqa: E402
from harness_learning import ensure_model, template  # noqa: E402

REPO_HARNESS = "mini-swe-agent-text"


@dataclass
class Arm:
    preset: str  # "demo" or "repo"
    dynamic: bool
    minutes: float
    points: list | None = None
    minutes_used: float = math.nan
    status: str = "not started"
    error: str = ""

    @property
    def name(self) -> str:
        return f"{self.preset}_{'on' if self.dynamic else 'off'}"


def preset_of(which: str) -> dict:
    """{"slug", "name", "model", "harness", "dataset", "reward_script", "config"} of the demo or the repo preset."""
    if which == "demo":
        raw = json.loads(PRESET.read_text())
        return {"slug": "arith-demo", **{k: raw[k] for k in ("name", "model", "harness", "dataset", "reward_script",
                                                              "config")}}
    raw = template(REPO_HARNESS)
    p = raw["preset"]
    return {"slug": REPO_HARNESS, "name": f"{REPO_HARNESS} on {p['dataset']}", "model": p["model"],
            "harness": REPO_HARNESS, "dataset": p["dataset"], "reward_script": p["reward_script"],
            "config": p["config"]}


def run_arm(arm: Arm, models_dir: Path, eval_every: int, eval_tasks: int | None, keep: Path | None) -> None:
    preset = preset_of(arm.preset)
    config = {**preset["config"], "dynamic_sampling": arm.dynamic, "eval_every": eval_every,
              "steps": 1000, "checkpoint_every": 0, "extra": {"preset": preset["slug"], "bench": "signal"}}
    if eval_tasks:
        config["eval_tasks"] = eval_tasks
    data_dir = Path(tempfile.mkdtemp(prefix=f"lw-signal-{arm.name}-", dir=keep))
    ensure_model(preset["model"], data_dir, models_dir)
    app = App(data_dir, models_dir, {"LIGHTNING_HARNESS_TOOLS_DIR": str(REPO / "data" / "harness-tools")})
    print(f"\n== {arm.name}: {preset['name']}, dynamic_sampling={'on' if arm.dynamic else 'off'}, {arm.minutes:g} min, "
          f"{config['tasks_per_step']}x{config['group_size']} a step, an evaluation of {config['eval_tasks']} val "
          f"tasks every {eval_every} steps", flush=True)
    try:
        app.start()
        token = Api(app.url).call("auth/token/", form={"username": "admin", "password": app.password()})["token"]
        api = Api(app.url, token)
        run, clicked = api.start_run(f"{preset['name']} (dynamic sampling {'on' if arm.dynamic else 'off'})",
                                     preset["model"], config, preset["harness"], preset["dataset"],
                                     preset["reward_script"])
        events = follow(api, run["id"], clicked, "budget", budget_minutes=arm.minutes)
        final = api.call(f"runs/{run['id']}/")
        arm.status, arm.error = final["status"], final.get("error") or ""
        arm.points, statuses = curve(events, clicked)
        arm.minutes_used = max(statuses.values(), default=math.nan)
    finally:
        app.stop()
        if keep is None:
            shutil.rmtree(data_dir, ignore_errors=True)


def print_arm(arm: Arm) -> None:
    print(f"\n{arm.name}: {arm.status} after {arm.minutes_used:.1f} min"
          f"{(': ' + arm.error.splitlines()[0]) if arm.error and arm.status == 'failed' else ''}")
    print("minutes  step  reward  groups: sampled signal trained dropped  share(trained) share(sampled) | eval pass@1")
    for minutes, step, v in arm.points or []:
        if "eval/pass@1" in v:
            print(f"{minutes:7.1f}  {step:4d}  {'':6s}  {'':47s} | {v['eval/pass@1']:.3f}")
        if "reward/mean" in v:
            print(f"{minutes:7.1f}  {step:4d}  {v['reward/mean']:6.3f}  {v.get('groups/sampled', math.nan):15.0f} "
                  f"{v.get('groups/with_signal', math.nan):6.0f} {v.get('groups/trained', math.nan):7.0f} "
                  f"{v.get('groups/dropped_no_signal', math.nan):7.0f}  {v.get('groups/signal_share', math.nan):14.2f} "
                  f"{v.get('groups/sampled_signal_share', math.nan):14.2f} |")


def gain(arm: Arm | None) -> float:
    evals = [v["eval/pass@1"] for _, _, v in (arm.points or []) if "eval/pass@1" in v] if arm else []
    return 100 * (evals[-1] - evals[0]) if len(evals) >= 2 else math.nan


def steps_of(arm: Arm | None) -> list[dict]:
    return [v for _, _, v in (arm.points or []) if "groups/trained" in v] if arm else []


def mean_share(arms: list[Arm]) -> float:
    shares = [v["groups/signal_share"] for arm in arms for v in steps_of(arm)]
    return sum(shares) / len(shares) if shares else math.nan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("demo", "repo"), help="run one preset's pair (the other reads nan)")
    parser.add_argument("--demo-minutes", type=float, default=20.0, help="minutes per demo arm, from the click")
    parser.add_argument("--repo-minutes", type=float, default=60.0, help="minutes per repository-suite arm")
    parser.add_argument("--demo-eval-every", type=int, default=0,
                        help="steps between the demo arms' evaluations (0: at step 0 and at the end only)")
    parser.add_argument("--repo-eval-every", type=int, default=0,
                        help="steps between the repo arms' evaluations (0: at step 0 and at the end only)")
    parser.add_argument("--demo-eval-tasks", type=int, help="val tasks per demo evaluation (default: the preset's)")
    parser.add_argument("--repo-eval-tasks", type=int, default=14,
                        help="val tasks per repo evaluation (2 of each of the 7 val templates)")
    parser.add_argument("--models-dir", type=Path, help="a models registry to reuse (default: a temporary one)")
    parser.add_argument("--keep", type=Path, help="keep each arm's data dir under this folder")
    args = parser.parse_args()

    models_dir = args.models_dir or Path(tempfile.mkdtemp(prefix="lw-signal-models-"))
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    arms = []
    for which in ("demo", "repo"):
        if args.only in (None, which):
            minutes = args.demo_minutes if which == "demo" else args.repo_minutes
            arms += [Arm(which, False, minutes), Arm(which, True, minutes)]
    try:
        for arm in arms:
            every = args.demo_eval_every if arm.preset == "demo" else args.repo_eval_every
            tasks = args.demo_eval_tasks if arm.preset == "demo" else args.repo_eval_tasks
            run_arm(arm, models_dir, every, tasks, args.keep)
    finally:
        if args.models_dir is None:
            shutil.rmtree(models_dir, ignore_errors=True)
    for arm in arms:
        print_arm(arm)
    by_name = {arm.name: arm for arm in arms}
    on = [a for a in arms if a.dynamic]
    extra = sum(v.get("rollout/extra", 0.0) for a in on for v in steps_of(a))
    trained_rollouts = sum(v["groups/trained"] * preset_of(a.preset)["config"]["group_size"]
                           for a in on for v in steps_of(a))
    per_arm = " ".join(f"{a.name}_steps={len(steps_of(a))} {a.name}_minutes={a.minutes_used:.1f} "
                       f"{a.name}_status={a.status}" for a in arms)
    print(f"RESULT demo_gain_on={gain(by_name.get('demo_on')):.1f} demo_gain_off={gain(by_name.get('demo_off')):.1f} "
          f"repo_gain_on={gain(by_name.get('repo_on')):.1f} repo_gain_off={gain(by_name.get('repo_off')):.1f} "
          f"signal_share_on={mean_share(on):.3f} signal_share_off={mean_share([a for a in arms if not a.dynamic]):.3f} "
          f"extra_rollouts={(extra / trained_rollouts) if trained_rollouts else math.nan:.3f} {per_arm}")


if __name__ == "__main__":
    main()
