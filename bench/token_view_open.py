"""Benchmark: how fast the token view (/samples/<id>/tokens/) opens a 32,768-token sample in real Chromium,
against a 1,024-token one, in the same run.

    flock /tmp/lw-heavy.lock .venv/bin/python bench/token_view_open.py            # PostgreSQL on 127.0.0.1:5432
    flock /tmp/lw-heavy.lock .venv/bin/python bench/token_view_open.py --sqlite   # a SQLite file in the data dir

It sets up as bench/dashboard_load.py does (a temporary data dir, a fresh database `lightning_bench_<pid>` or a
SQLite file, migrated and dropped at the end, a models registry whose `tiny` is a real tiny model) and seeds one
user, a run of `tiny`, a rollout and two samples (1,024 and 32,768 tokens: the tiny tokenizer's encoding of
generated text, cut into calls of a context span then a trained span each, with behaviour and trainer logprobs
and the spans). The app is served by daphne in a subprocess; Debian's Chromium, driven by Playwright, logs in and
opens each sample's token view --repeat times in turn (1k, 32k, 1k, ...), after one first load each that warms
the server's tokenizer cache (reported on its own line).

Times come from the page's own clock (performance.now(), from navigation start), read by a MutationObserver
installed before the page's scripts run:
- html: the page's HTML has arrived (Navigation Timing's responseEnd): the server's share;
- open: the first `span.tok` is in #token-view, and the frame after it has been drawn (requestAnimationFrame,
  then a task): the first screen is usable;
- all: #token-view[data-rendered] equals data-total (static/js/token_view.js renders the rest chunk by chunk on
  its own, not lazily on scroll), and its frame drawn; window.tokenView.renderAll() must agree.

Last line: RESULT open_32k_s=<median> open_1k_s=<median> open_ratio=<32k/1k> all_32k_s=<median>.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from bench.dashboard_load import PG, cleanup, setup_django  # noqa: E402
from bench.seed_big_run import text  # noqa: E402

SIZES = (1024, 32768)
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]
PASSWORD = "bench-password-123"

# Installed before any page script: window.__tv.open / .all are performance.now() after the frame that showed the
# first token / the last one.
PROBE = """
window.__tv = {open: null, all: null};
const painted = (key) => requestAnimationFrame(() => setTimeout(() => { window.__tv[key] = performance.now(); }));
let openSeen = false, allSeen = false;
new MutationObserver(() => {
  const view = document.getElementById("token-view");
  if (!view) return;
  if (!openSeen && view.querySelector("span.tok")) { openSeen = true; painted("open"); }
  if (!allSeen && Number(view.dataset.rendered) > 0 && view.dataset.rendered === view.dataset.total) {
    allSeen = true; painted("all");
  }
}).observe(document, {childList: true, subtree: true, attributes: true, attributeFilter: ["data-rendered"]});
"""


def seed_samples(models_dir: Path) -> dict[int, int]:
    """One user, a run of the registry's `tiny`, a rollout and a sample of each size: {size: sample id}."""
    from django.contrib.auth import get_user_model
    from transformers import AutoTokenizer

    from catalog import services as catalog_services
    from runs import services
    from runs.models import ModelCall, Rollout, Sample

    user = get_user_model().objects.create_user("bench", password=PASSWORD)
    harness = catalog_services.create_harness(user, name="agent", command=["python", "agent.py", "{task_file}",
                                                                    "{output_file}"])
    reward = catalog_services.create_reward_script(user, name="one", source="def reward(task, outcome):\n    return 1.0\n")
    dataset = catalog_services.create_dataset(user, name="tasks", content=b'{"id": "t1", "question": "q"}\n',
                                      filename="tasks.jsonl")
    with mock.patch.object(services, "enqueue_run", lambda run_id: None):  # no worker: the run is seeded
        run = services.create_run(user, name="token view", model="tiny", reward_script=reward, harness=harness,
                                  dataset=dataset, config={"steps": 2})
    assert run.model_info.get("path"), f"the run's model has no path: {run.model_info}"
    begin = datetime.now(timezone.utc) - timedelta(minutes=10)
    rollout = Rollout.objects.create(
        run=run, split="train", step=1, batch_step=1, trained_step=1, group=0, attempt=0, policy_version=0,
        status="succeeded", reward=1.0, reward_detail={"reward": 1.0}, exit_code=0, call_count=0, started_at=begin,
        finished_at=begin + timedelta(seconds=60))
    tokenizer = AutoTokenizer.from_pretrained(models_dir / "tiny")
    rng = random.Random(0)
    ids: list[int] = []
    while len(ids) < max(SIZES):
        ids += tokenizer.encode(text(rng, 4000) + "\n", add_special_tokens=False)
    samples, seq = {}, 0
    for index, size in enumerate(SIZES):
        token_ids = ids[:size]
        per_call = 1024 if size > 1024 else 256  # 4 calls for 1k, 32 for 32k
        mask, logprobs, trainer, spans, calls = [], [], [], [], []
        for start in range(0, size, per_call):
            end = min(size, start + per_call)
            middle = start + (end - start) // 2
            sampled = [-rng.expovariate(4.0) for _ in range(end - middle)]
            mask += [0] * (middle - start) + [1] * (end - middle)
            logprobs += [0.0] * (middle - start) + sampled
            trainer += [None] * (middle - start) + [lp - rng.uniform(0, 0.05) for lp in sampled]
            spans += [[seq, start, middle, False], [seq, middle, end, True]]
            calls.append(ModelCall(
                rollout=rollout, seq=seq, api="chat", request={"model": "policy", "messages": []},
                response={"id": f"chatcmpl-{seq}", "object": "chat.completion", "model": "policy", "choices": []},
                prompt_ids=token_ids[:middle], completion_ids=token_ids[middle:end], logprobs=sampled,
                finish_reason="stop", status_code=200, latency_ms=500.0, policy_version=0, drift="clean"))
            seq += 1
        ModelCall.objects.bulk_create(calls, batch_size=8)
        sample = Sample.objects.create(
            rollout=rollout, index=index, token_ids=token_ids, loss_mask=mask, logprobs=logprobs,
            trainer_logprobs=trainer, advantage=0.5, call_seqs=[c.seq for c in calls], spans=spans, build="merged",
            step=1, policy_version=0)
        samples[size] = sample.pk
    Rollout.objects.filter(pk=rollout.pk).update(call_count=seq)
    return samples


def serve(data_dir: Path, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """daphne on a free port over the benchmark's database and data dir; (process, base URL)."""
    from common.procs import free_port

    port = free_port()
    log = open(data_dir / "daphne.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port),
                             "lightning_web.asgi:application"], cwd=REPO, env=env, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url + "/accounts/login/", timeout=2)
            return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"daphne did not start:\n{(data_dir / 'daphne.log').read_text()}")
            time.sleep(0.2)


def open_once(page, url: str, total: int) -> tuple[float, float, float]:
    """(html s, open s, all s) of one navigation to a token view, from the page's navigation start (from a blank page:
    tearing down the previous view's 32k spans is not this view's time)."""
    page.goto("about:blank")
    page.goto(url, wait_until="commit")
    page.wait_for_function("window.__tv && window.__tv.all !== null", timeout=120_000, polling=50)
    html, opened, done = page.evaluate('[performance.getEntriesByType("navigation")[0].responseEnd, '
                                       'window.__tv.open, window.__tv.all]')
    rendered = page.evaluate("window.tokenView.renderAll()")
    assert rendered == total, f"{url}: rendered {rendered} of {total} tokens"
    assert page.locator("#token-view span.tok").count() == total
    return html / 1000, opened / 1000, done / 1000


def measure(base: str, samples: dict[int, int], repeat: int) -> dict[int, dict[str, list[float]]]:
    from playwright.sync_api import sync_playwright

    times = {size: {"html": [], "open": [], "all": []} for size in samples}
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(base + "/accounts/login/")
        page.fill("input[name=username]", "bench")
        page.fill("input[name=password]", PASSWORD)
        page.click("button[type=submit]")
        page.wait_for_url(lambda u: "/accounts/login/" not in u)
        page.add_init_script(PROBE)
        urls = {size: f"{base}/samples/{pk}/tokens/" for size, pk in samples.items()}
        for size in samples:  # the first load: the server decodes the sample once and caches it
            html, opened, done = open_once(page, urls[size], size)
            print(f"first load {size:>6} tokens: html {html:.3f} s, open {opened:.3f} s, all {done:.3f} s", flush=True)
        for _ in range(repeat):
            for size in samples:  # in turn: the machine's noise hits both alike
                html, opened, done = open_once(page, urls[size], size)
                times[size]["html"].append(html)
                times[size]["open"].append(opened)
                times[size]["all"].append(done)
        browser.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sqlite", action="store_true", help="a SQLite file instead of PostgreSQL")
    parser.add_argument("--repeat", type=int, default=5, help="timed loads of each sample (after one first load)")
    args = parser.parse_args()
    settings_args = SimpleNamespace(sqlite=args.sqlite, reuse=None, keep=False)  # what dashboard_load's helpers read
    data_dir = Path(tempfile.mkdtemp(prefix="lw-token-view-bench-"))
    db_name = f"lightning_bench_{os.getpid()}"
    proc = None
    try:
        setup_django(settings_args, data_dir, db_name)
        from django.db import connection

        samples = seed_samples(data_dir / "models")
        print(f"database: {connection.vendor} {connection.settings_dict['NAME']}; samples {samples}", flush=True)
        env = {k: v for k, v in os.environ.items() if k != "DJANGO_ALLOW_ASYNC_UNSAFE"}
        if not args.sqlite:
            env["DATABASE_URL"] = PG + db_name
        proc, base = serve(data_dir, env)
        os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API keeps a loop running
        times = measure(base, samples, args.repeat)
        median = {size: {key: statistics.median(values) for key, values in t.items()} for size, t in times.items()}
        print(f"{'tokens':>7} {'html s':>7} {'open s':>8} {'open min':>9} {'open max':>9} {'all s':>8} {'all min':>8} "
              f"{'all max':>8}  (median of {args.repeat})")
        for size, t in times.items():
            print(f"{size:>7} {median[size]['html']:7.3f} {median[size]['open']:8.3f} {min(t['open']):9.3f} "
                  f"{max(t['open']):9.3f} "
                  f"{median[size]['all']:8.3f} {min(t['all']):8.3f} {max(t['all']):8.3f}")
        small, big = median[SIZES[0]], median[SIZES[1]]
        print(f"RESULT open_32k_s={big['open']:.3f} open_1k_s={small['open']:.3f} "
              f"open_ratio={big['open'] / small['open']:.2f} all_32k_s={big['all']:.3f}")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=20)
        cleanup(settings_args, data_dir, db_name)


if __name__ == "__main__":
    main()
