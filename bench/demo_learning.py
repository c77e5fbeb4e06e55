"""Does the demo learn? The arithmetic demo run, started through the REST API on a fresh data dir, judged by val Pass@1.

    flock /tmp/lw-heavy.lock .venv/bin/python bench/demo_learning.py                  # the 20-minute measurement
    flock /tmp/lw-heavy.lock .venv/bin/python bench/demo_learning.py --minutes 3 --eval-tasks 20 --png /tmp/c.png

What a new user gets: `manage.py up` on a fresh data dir (SQLite, embedded Redis, first user, the demo loaded; web,
run worker and control worker, as `./lw up` starts them), then the demo preset (examples/arith/preset.json, the
one the dashboard's button and `./lw demo` start) created with POST /api/v1/runs/ ("clicking start"). The run
evaluates val Pass@1 before its first step and after its last one, each over `eval_tasks` val tasks with
`eval_samples` attempts at the rollout temperature (eval/pass@1, their mean) and one greedy attempt
(eval/pass@1_greedy).

The budget (--minutes, from the click to the end of the final evaluation, engine start included) becomes a step
count before the run starts, from the time model below; a run's step count is fixed once it starts. The bench
prints what each part really took and how many steps would have fit, so a machine slower or faster than the
model can be re-run with --steps.

`--cpu-isa avx2` runs all of it (app, workers, engine) with torch and oneDNN limited to AVX2
(trainer.host.ISA_LIMITS): the demo as a host without native bf16 runs it, where `auto` picks float32.

It prints the curve (per-step train reward and step time, each evaluation), exports the run page's chart as a PNG
(plotly.js in Debian's Chromium through Playwright), and last:
RESULT pass1_start=<x> pass1_end=<y> gain_points=<z> minutes=<m> (then the greedy figures, steps, status, the
ISA setting and the dtypes the run resolved).
"""
from __future__ import annotations

import argparse
import base64
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from common import procs  # noqa: E402
from trainer.host import ISA_LIMITS  # noqa: E402

PRESET = REPO / "examples" / "arith" / "preset.json"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
FINISHED = ("succeeded", "failed", "cancelled")
ATTEMPTS = 6
"""Tries of a GET the app does not answer in time (60 s each, 5-30 s apart)."""


@dataclass(frozen=True)
class TimeModel:
    """Seconds each part of the demo run takes on the 2-core machine.

    Measured 2026-12-03 (8 steps, 50 val tasks): click to `running` 111 s, 250 evaluation attempts in 79 s,
    median step 50 s (35 s of it training 8.8k tokens at about 250 tokens/s).
    """

    engine_start: float = 115.0
    """Click to the run running: queue, engine start (vLLM on CPU), the model loaded into the trainer."""
    eval_attempt: float = 0.32
    """One evaluation attempt (a harness episode of 2-3 calls) at eval_concurrency 32."""
    step: float = 50.0
    """One training step of 8 tasks x 4 attempts: generate, score, train, sync, record, checkpoint."""

    def steps_for(self, seconds: float, eval_attempts: int) -> int:
        """Most steps whose run (engine start, two evaluations, the steps) ends within `seconds`."""
        left = seconds - self.engine_start - 2 * eval_attempts * self.eval_attempt
        return max(1, math.floor(left / self.step))


class Api:
    """The app's REST API with a token, as a user's script would call it."""

    def __init__(self, url: str, token: str = ""):
        self.url, self.token = url.rstrip("/"), token

    def call(self, path: str, body: dict | None = None, form: dict | None = None) -> dict:
        headers = {"Authorization": f"Token {self.token}"} if self.token else {}
        data = None
        if body is not None:
            data, headers["Content-Type"] = json.dumps(body).encode(), "application/json"
        elif form is not None:
            data = "&".join(f"{k}={urllib.request.quote(str(v))}" for k, v in form.items()).encode()
            headers["Content-Type"] = "application/x-www-form-urlencoded"
        request = urllib.request.Request(self.url + "/api/v1/" + path, data=data, headers=headers,
                                         method="POST" if data is not None else "GET")
        for attempt in range(ATTEMPTS):
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as exc:
                raise SystemExit(f"{request.method} {path}: HTTP {exc.code}: {exc.read()[:500]!r}") from None
            except (TimeoutError, urllib.error.URLError, ConnectionError) as exc:
                # A 2-core machine busy with the run itself can keep the app from answering for a while: a
                # read is retried (never a POST, which may have been done), and the run goes on regardless.
                if data is not None or attempt == ATTEMPTS - 1:
                    raise
                print(f"  ({request.method} {path}: {exc}; retrying in {5 * (attempt + 1)} s)", flush=True)
                time.sleep(5 * (attempt + 1))

    def every(self, path: str) -> list[dict]:
        """All rows of a paginated list."""
        rows, page = [], self.call(path)
        while True:
            rows += page["results"]
            if not page.get("next"):
                return rows
            page = self.call(page["next"].split("/api/v1/", 1)[1])

    def start_run(self, name: str, model: str, config: dict, harness: str, dataset: str,
                  reward_script: str) -> tuple[dict, float]:
        """POST /runs/ with the harness, dataset and reward script named ("clicking start"): (the run, when)."""
        body = {"name": name, "model": model, "config": config, "harness": self.id_of("harnesses", harness),
                "dataset": self.id_of("datasets", dataset), "reward_script": self.id_of("reward-scripts", reward_script)}
        clicked = time.time()
        return self.call("runs/", body), clicked

    def id_of(self, kind: str, name: str) -> int:
        for row in self.every(f"{kind}/"):
            if row["name"] == name:
                return row["id"]
        raise SystemExit(f"no {kind} named {name!r}: `manage.py up` should have loaded the demo")


class App:
    """`manage.py up` on a fresh data dir, in its own process group; stop() takes everything down."""

    def __init__(self, data_dir: Path, models_dir: Path | None, extra_env: dict | None = None):
        self.extra_env = dict(extra_env or {})
        self.data_dir, self.models_dir = data_dir, models_dir
        self.port = procs.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 600.0) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "LIGHTNING_MODELS_DIR")}
        # The app's embedded Redis ends with this bench, however it ends (lightning_web/embedded_redis.py).
        env.update(LIGHTNING_DATA_DIR=str(self.data_dir), PYTHONUNBUFFERED="1",
                   LIGHTNING_EMBEDDED_REDIS_OWNER=str(os.getpid()), **self.extra_env)
        if self.models_dir:
            env["LIGHTNING_MODELS_DIR"] = str(self.models_dir)
        self.log = open(self.data_dir / "up.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "manage.py", "up", "--host", "127.0.0.1", "--port", str(self.port)],
                                     cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout_s  # a first start imports SmolLM2 (about half a minute)
        while not _answers(self.url + "/accounts/login/"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the app did not start; see {self.data_dir / 'up.log'}:\n{self.tail()}")
            time.sleep(1)

    def tail(self, lines: int = 30) -> str:
        return "\n".join((self.data_dir / "up.log").read_text(errors="replace").splitlines()[-lines:])

    def password(self) -> str:
        return (self.data_dir / "admin_password").read_text().strip()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            # SIGTERM: up stops web and workers, a worker its engine; SIGKILL only after a minute.
            procs.kill_group(self.proc.pid, grace_s=60)
            self.proc.wait()
        from lightning_web import embedded_redis

        embedded_redis.stop(self.data_dir)  # the embedded Redis this data dir started


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _when(event: dict) -> float:
    return datetime.fromisoformat(event["created_at"]).timestamp()


BUDGET_GRACE_MINUTES = 15.0
"""How far past its budget a budgeted run may go (a step or an evaluation far longer than measured) before it is
cancelled outright."""


def follow(api: Api, run_id: int, clicked: float, steps: int | str, budget_minutes: float | None = None) -> list[dict]:
    """Print the run's progress until it ends; its events, in order.

    With `budget_minutes` (bench/learning_signal.py's same-minutes arms), the run is asked to finish (POST
    runs/{id}/finish/: the step in progress becomes its last, then its final evaluation) as soon as one more step
    would no longer fit: once the minutes spent, what is left of the step in progress, one more step (the median
    so far) and an evaluation (the last one's) pass the budget. So every arm ends with an evaluation near its
    budget, whatever its step length. A run still going BUDGET_GRACE_MINUTES past it is cancelled."""
    events, after, last_step, status, finishing, cancelled = [], 0, -1, "queued", False, False
    step_seconds, eval_seconds, step_ended = [], 0.0, time.time()
    while status not in FINISHED:
        time.sleep(2)
        new = api.every(f"runs/{run_id}/events/?after={after}")
        events += new
        after = new[-1]["seq"] if new else after
        for event in new:
            values = event["payload"].get("values", {}) if event["kind"] == "run.metrics" else {}
            if "time/step" in values:
                step_seconds.append(values["time/step"])
            eval_seconds = values.get("eval/seconds", eval_seconds)
        run = api.call(f"runs/{run_id}/")
        status = run["status"]
        now = time.time()
        spent = (now - clicked) / 60
        if run["step"] != last_step or status in FINISHED:
            last_step, step_ended = run["step"], now
            print(f"  {spent:5.1f} min  step {last_step}/{steps}  {status}  {run.get('phase', '')}", flush=True)
        if budget_minutes is None or status in FINISHED:
            continue
        if step_seconds and not finishing and status == "running":
            step_s = sorted(step_seconds)[len(step_seconds) // 2]
            left_of_this_step = max(0.0, step_s - (now - step_ended))
            if spent + (left_of_this_step + step_s + eval_seconds) / 60 >= budget_minutes:
                print(f"  {spent:5.1f} min  another step ({step_s:.0f} s) and the evaluation ({eval_seconds:.0f} s) "
                      f"would pass {budget_minutes:g} min: finishing after step {last_step + 1}", flush=True)
                api.call(f"runs/{run_id}/finish/", body={})
                finishing = True
        if spent >= budget_minutes + BUDGET_GRACE_MINUTES and not cancelled:
            print(f"  {spent:5.1f} min  {BUDGET_GRACE_MINUTES:g} min past the budget: cancelling", flush=True)
            api.call(f"runs/{run_id}/cancel/", body={})
            cancelled = True
    return events + api.every(f"runs/{run_id}/events/?after={after}")


def curve(events: list[dict], clicked: float) -> tuple[list[tuple[float, int, dict]], dict[str, float]]:
    """(minutes after the click, step, metric values) per metrics event, and when each status began."""
    points, statuses = [], {}
    for event in events:
        if event["kind"] == "run.metrics":
            points.append(((_when(event) - clicked) / 60, event["payload"]["step"], event["payload"]["values"]))
        elif event["kind"] == "run.status":
            statuses.setdefault(event["payload"]["status"], (_when(event) - clicked) / 60)
    return points, statuses


def print_curve(points: list[tuple[float, int, dict]]) -> None:
    print("minutes  step  reward  step_s | eval: pass@1  pass@k  greedy  tasks")
    for minutes, step, values in points:
        if "eval/pass@1" in values:
            print(f"{minutes:7.1f}  {step:4d}  {'':6s}  {'':6s} | {values['eval/pass@1']:12.3f}  "
                  f"{values.get('eval/pass@k', float('nan')):6.3f}  {values.get('eval/pass@1_greedy', float('nan')):6.3f}"
                  f"  {values.get('eval/tasks', 0):5.0f}")
        if "reward/mean" in values:
            print(f"{minutes:7.1f}  {step:4d}  {values['reward/mean']:6.3f}  {values.get('time/step', float('nan')):6.1f} |")


def budget_check(points, statuses, model: TimeModel, budget_s: float, eval_attempts: int) -> None:
    """What the parts took against the time model, and the steps that would have fit the budget."""
    evals = [(m, s) for m, s, v in points if "eval/pass@1" in v]
    steps = [v["time/step"] for _, _, v in points if "time/step" in v]
    running = statuses.get("running")
    if not evals or running is None:
        return
    first_eval_s = (evals[0][0] - running) * 60
    step_s = sorted(steps)[len(steps) // 2] if steps else model.step
    measured = TimeModel(engine_start=running * 60, eval_attempt=first_eval_s / max(eval_attempts, 1), step=step_s)
    print(f"time: engine start {measured.engine_start:.0f} s (model {model.engine_start:.0f}), evaluation "
          f"{first_eval_s:.0f} s for {eval_attempts} attempts (model {model.eval_attempt * eval_attempts:.0f}), "
          f"median step {step_s:.1f} s (model {model.step:.1f}); steps that fit {budget_s / 60:.0f} min: "
          f"{measured.steps_for(budget_s, eval_attempts)}")


def export_png(url: str, password: str, run_id: int, path: Path) -> None:
    """The run page's chart as PNG, rendered by plotly.js in Chromium (the page as a user sees it)."""
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    if not os.path.exists(chromium):
        raise SystemExit("Debian's chromium is missing: apt-get install -y chromium")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 900})
            page.goto(url + "/accounts/login/")
            page.fill("input[name=username]", "admin")
            page.fill("input[name=password]", password)
            page.click("button[type=submit]")
            page.wait_for_selector("h1:has-text('Runs')")
            page.goto(f"{url}/runs/{run_id}/")
            page.wait_for_selector("#run-chart[data-ready='1']", timeout=60000)
            data_url = page.evaluate("() => Plotly.toImage(document.getElementById('run-chart'), "
                                     "{format: 'png', width: 900, height: 480, scale: 2})")
        finally:
            browser.close()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(base64.b64decode(data_url.split(",", 1)[1]))
    print(f"chart written to {path}")


def try_export_png(url: str, password: str, run_id: int, path: Path) -> None:
    """export_png, but a chart that cannot be drawn (no Chromium, a page that does not load) is reported and the
    bench goes on to its RESULT: a long run's figures are never lost to the picture."""
    try:
        export_png(url, password, run_id, path)
    except (SystemExit, Exception) as exc:  # noqa: BLE001 (Playwright raises its own errors)
        print(f"chart not exported: {exc}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="budget from the click to the final evaluation")
    parser.add_argument("--steps", type=int, help="train this many steps instead of what the budget allows")
    parser.add_argument("--eval-tasks", type=int, help="val tasks per evaluation (default: the preset's)")
    parser.add_argument("--step-seconds", type=float, default=TimeModel.step, help="time model: one step")
    parser.add_argument("--engine-seconds", type=float, default=TimeModel.engine_start,
                        help="time model: engine start")
    parser.add_argument("--eval-attempt-seconds", type=float, default=TimeModel.eval_attempt,
                        help="time model: one evaluation attempt")
    parser.add_argument("--data-dir", type=Path, help="a fresh data dir (default: a new temporary one, removed after)")
    parser.add_argument("--models-dir", type=Path, help="a models registry to reuse (default: the data dir's own)")
    parser.add_argument("--png", type=Path, default=REPO / "docs" / "demo-curve.png", help="where the chart goes")
    parser.add_argument("--no-png", action="store_true", help="do not export the chart")
    parser.add_argument("--cpu-isa", choices=("native", *ISA_LIMITS), default="native",
                        help="limit torch and oneDNN in the app, its workers and the engine to this ISA")
    args = parser.parse_args()

    preset = json.loads(PRESET.read_text())
    config = {**preset["config"], "extra": {"preset": "arith-demo"}}  # as the demo button tags it (runs.presets)
    if args.eval_tasks is not None:
        config["eval_tasks"] = args.eval_tasks
    eval_attempts = config["eval_tasks"] * (config.get("eval_samples", 1) + bool(config.get("eval_greedy")))
    model = TimeModel(args.engine_seconds, args.eval_attempt_seconds, args.step_seconds)
    config["steps"] = args.steps or model.steps_for(args.minutes * 60, eval_attempts)

    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="lw-demo-bench-"))
    data_dir.mkdir(parents=True, exist_ok=True)
    if any(data_dir.glob("db.sqlite3")):
        raise SystemExit(f"{data_dir} is not fresh (it holds a database); give a new --data-dir")
    app = App(data_dir, args.models_dir, ISA_LIMITS.get(args.cpu_isa))
    try:
        print(f"starting the app on {data_dir} (migrate, first user, SmolLM2 import, demo) ...", flush=True)
        app.start()
        token = Api(app.url).call("auth/token/", form={"username": "admin", "password": app.password()})["token"]
        api = Api(app.url, token)
        run, clicked = api.start_run(preset["name"], preset["model"], config, preset["harness"], preset["dataset"],
                                     preset["reward_script"])
        print(f"run {run['id']}: {config['steps']} steps of {config['tasks_per_step']}x{config['group_size']}, "
              f"evaluations of {config['eval_tasks']} val tasks x ({config.get('eval_samples', 1)} sampled"
              f"{' + greedy' if config.get('eval_greedy') else ''}); budget {args.minutes:g} min", flush=True)
        events = follow(api, run["id"], clicked, config["steps"])
        status = api.call(f"runs/{run['id']}/")
        print(f"host: {status.get('host', {}).get('summary', 'not recorded')}")
        points, statuses = curve(events, clicked)
        print_curve(points)
        budget_check(points, statuses, model, args.minutes * 60, eval_attempts)
        if status["status"] != "succeeded":
            print(f"run {run['id']} {status['status']}: {status.get('error', '')}\n{app.tail()}")
        if not args.no_png:
            try_export_png(app.url, app.password(), run["id"], args.png)
    finally:
        app.stop()
        if args.data_dir is None:
            shutil.rmtree(data_dir, ignore_errors=True)
    evals = [(m, v) for m, _, v in points if "eval/pass@1" in v]
    if len(evals) < 2:
        raise SystemExit(f"RESULT status={status['status']}: fewer than two evaluations, nothing to compare")
    (_, first), (end_minutes, last) = evals[0], evals[-1]
    formats = status.get("host", {}).get("formats", {})
    print(f"RESULT pass1_start={first['eval/pass@1']:.3f} pass1_end={last['eval/pass@1']:.3f} "
          f"gain_points={100 * (last['eval/pass@1'] - first['eval/pass@1']):.1f} minutes={end_minutes:.1f} "
          f"greedy_start={first.get('eval/pass@1_greedy', float('nan')):.3f} "
          f"greedy_end={last.get('eval/pass@1_greedy', float('nan')):.3f} steps={config['steps']} "
          f"status={status['status']} cpu_isa={args.cpu_isa} engine_dtype={formats.get('engine_dtype', '?')} "
          f"trainer_dtype={formats.get('trainer_dtype', '?')}")


if __name__ == "__main__":
    main()
