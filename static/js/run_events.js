// The run page's header (status, step, policy version, elapsed time, ETA, what the run is doing now) and its event
// log as readable lines, both kept current from the run's events (run_page.js feeds them). Text, never HTML.
const FINISHED = new Set(["succeeded", "failed", "cancelled"]);
const CANCELLABLE = new Set(["queued", "starting", "running"]);
const FINISHABLE = new Set(["starting", "running"]);  // services.finish_run
const LOG_LIMIT = 500;
const ETA_WINDOW = 20;  // the median of the last 20 step times (as runs.pages.run_page.ETA_WINDOW)
const LOG_METRICS = ["reward/mean", "reward/std", "eval/pass@1", "eval/pass@1_greedy", "loss/total", "time/step"];

export function durationText(seconds) {  // the same format as runs.pages.run_page.duration_text
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return "–";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${String(s % 60).padStart(2, "0")}s`;
  return `${Math.floor(s / 3600)}h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
}

function median(values) {
  const sorted = [...values].sort((a, b) => a - b);
  const mid = Math.floor(sorted.length / 2);
  return sorted.length % 2 ? sorted[mid] : (sorted[mid - 1] + sorted[mid]) / 2;
}

// The learning-signal notice, as runs.signal.notice words it: the mean share of sampled groups whose attempts scored
// differently over the last `window` steps, below `low_share`.
export function signalNotice(steps, signal) {
  const recent = steps.filter((s) => typeof s.share === "number").slice(-signal.window);
  if (recent.length < signal.window) return null;
  const share = recent.reduce((sum, s) => sum + s.share, 0) / recent.length;
  if (share >= signal.low_share) return null;
  const first = recent[0].step;
  const last = recent[recent.length - 1].step;
  let text = `Groups are losing their learning signal: in steps ${first}-${last}, ${Math.round(share * 100)}% of ` +
    "the groups sampled had attempts that scored differently. GRPO learns only from those, so the reward curve " +
    "will flatten.";
  const dropped = recent.reduce((sum, s) => sum + (s.dropped || 0), 0);
  if (signal.dynamic_sampling) {
    text += ` Dynamic sampling dropped ${dropped} group${dropped !== 1 ? "s" : ""} without signal in these steps.`;
  } else {
    text += " Clone the run with dynamic_sampling on, or raise temperature or group_size.";
  }
  return { share, steps: [first, last], text };
}

function sampledShare(values) {  // as runs.signal.sampled_share
  if (typeof values["groups/sampled_signal_share"] === "number") return values["groups/sampled_signal_share"];
  const total = values["groups/total"];
  return total ? (values["groups/with_signal"] || 0) / total : null;
}

export class RunHeader {
  constructor(config) {
    this.config = config;
    this.status = config.status;
    this.step = config.step;
    this.steps = config.steps;
    this.startedAt = config.started_at ? Date.parse(config.started_at) : null;
    this.finishedAt = config.finished_at ? Date.parse(config.finished_at) : null;
    this.stepTimes = new Map();  // step -> time/step seconds (for the ETA)
    this.signal = config.signal || { steps: [], window: 2, low_share: 0.5, dynamic_sampling: false };
    this.signalSteps = new Map(this.signal.steps.map((s) => [s.step, s]));  // step -> {step, share, dropped}
    this.el = (id) => document.getElementById(id);
    setInterval(() => this.tick(), 1000);
  }

  apply(event) {
    const { kind, payload } = event;
    // The server drew the state as of config.last_seq: older events (the replay) only feed the ETA, so the
    // header does not flicker through the run's history.
    const fresh = event.seq > this.config.last_seq;
    if (kind === "run.status" && fresh) this.applyStatus(event);
    else if (kind === "run.phase" && fresh) this.showPhase(payload.phase, payload.progress);
    else if (kind === "run.metrics") {
      // The run's step and policy version move together (rollout_services.record_step writes both).
      if (fresh && payload.step > this.step) this.setStep(payload.step);
      const stepTime = payload.values?.["time/step"];
      if (typeof stepTime === "number") this.stepTimes.set(payload.step, stepTime);
      const share = sampledShare(payload.values || {});
      if (typeof share === "number") {
        this.signalSteps.set(payload.step, { step: payload.step, share,
                                             dropped: payload.values["groups/dropped_no_signal"] || 0 });
        this.showSignal();
      }
    } else if (kind === "run.log" && fresh && typeof payload.steps === "number") {
      this.setSteps(payload.steps);  // finished early by its owner (services.finish_run): fewer steps in all
    } else if (kind === "run.resumed") {
      if (fresh) {
        this.setStep(payload.step, true);
        this.showPhase(`back to the checkpoint of step ${payload.step}`, null);
      }
      for (const step of [...this.stepTimes.keys()]) if (step > payload.step) this.stepTimes.delete(step);
      for (const step of [...this.signalSteps.keys()]) if (step > payload.step) this.signalSteps.delete(step);
      this.showSignal();
    }
    this.tick();
  }

  showSignal() {
    const el = this.el("run-signal");
    if (!el) return;
    const steps = [...this.signalSteps.values()].sort((a, b) => a.step - b.step);
    const found = signalNotice(steps, this.signal);
    el.hidden = !found;
    el.textContent = found ? found.text : "";
  }

  applyStatus(event) {
    const { status, error, host, worker, isolation } = event.payload;
    const before = this.status;
    this.status = status;
    const badge = this.el("run-status");
    badge.textContent = status;
    badge.className = `status status-${status}`;
    const errorLine = this.el("run-error");
    if (error) errorLine.textContent = error;
    else if (status === "queued" || status === "starting") errorLine.textContent = "";  // a fresh go
    if (host) this.el("run-host").textContent = host;  // the worker's CPU and the dtypes it chose (trainer.host)
    if (worker?.where) this.el("run-worker").textContent = worker.where;  // "starting": the worker that took it
    if (isolation) this.el("run-isolation").textContent = isolation;  // "running": how its user code is isolated
    const at = Date.parse(event.created_at);
    if (status === "running" && this.startedAt === null) this.startedAt = at;
    if (FINISHED.has(status)) {
      this.finishedAt = at;
      this.showPhase("", null);
    } else {
      this.finishedAt = null;
    }
    this.el("cancel-form").hidden = !CANCELLABLE.has(status);
    if (!FINISHABLE.has(status)) this.el("finish-form").hidden = true;
    const waiting = this.el("run-waiting");  // "waiting for pool X (n ahead)", drawn by the server while queued
    if (waiting && status !== "queued") waiting.hidden = true;
    // Resume / continue forms are drawn by the server for the status it saw; a run that ends later needs a reload.
    if (FINISHED.has(status) && !FINISHED.has(before)) {
      this.el("go-on-reload").hidden = false;
    }
  }

  setStep(step, exact = false) {
    this.step = exact ? step : Math.max(this.step, step);
    this.el("run-step").textContent = String(this.step);
    this.el("run-policy-version").textContent = String(this.step);
    const bar = this.el("run-step-progress");
    if (bar) bar.value = this.step;
  }

  setSteps(steps) {
    this.steps = steps;
    const total = this.el("run-steps");
    if (total) total.textContent = String(steps);
    const bar = this.el("run-step-progress");
    if (bar) bar.max = steps;
    this.el("finish-form").hidden = true;  // it is asked; once is enough
  }

  showPhase(phase, progress) {
    const bar = this.el("run-phase-progress");
    const known = typeof progress === "number";
    this.el("run-phase").textContent = known ? `${phase} (${Math.round(progress * 100)}%)` : phase;
    bar.hidden = !known;
    if (known) bar.value = progress;
  }

  tick() {
    if (this.startedAt !== null) {
      const end = this.finishedAt ?? Date.now();
      this.el("run-elapsed").textContent = durationText((end - this.startedAt) / 1000);
    }
    this.el("run-eta").textContent = durationText(this.eta());
  }

  eta() {
    if (FINISHED.has(this.status) || this.status === "queued" || !this.steps || !this.stepTimes.size) return null;
    const recent = [...this.stepTimes.entries()].sort((a, b) => b[0] - a[0]).slice(0, ETA_WINDOW);
    return median(recent.map(([, seconds]) => seconds)) * Math.max(0, this.steps - this.step);
  }
}

// One readable line an event; null for the events shown elsewhere (phases in the header, rollouts in the table).
export function eventLine(event) {
  const { kind, payload } = event;
  const time = new Date(event.created_at).toLocaleTimeString([], { hour12: false });
  if (kind === "run.status") {
    return `${time} status → ${payload.status}${payload.error ? `: ${payload.error}` : ""}`;
  }
  if (kind === "run.log") return `${time} ${payload.line}`;
  if (kind === "run.metrics") {
    const names = Object.keys(payload.values || {});
    const shown = LOG_METRICS.filter((name) => name in payload.values);
    const picked = shown.length ? shown : names.slice(0, 4);
    const parts = picked.map((name) => `${name} ${formatNumber(payload.values[name])}`);
    const more = names.length - picked.length;
    return `${time} step ${payload.step}: ${parts.join(" · ")}${more > 0 ? ` … (+${more} more)` : ""}`;
  }
  if (kind === "run.resumed") {
    const redone = (payload.dropped_steps || []).length;
    return `${time} resumed from the checkpoint of step ${payload.step}: ${payload.lost_rollouts} rollouts lost` +
      (redone ? `, steps ${payload.dropped_steps.join(", ")} to be redone` : "");
  }
  return null;
}

function formatNumber(value) {
  if (typeof value !== "number") return String(value);
  if (Number.isInteger(value)) return String(value);
  return Math.abs(value) >= 100 ? value.toFixed(1) : value.toPrecision(3);
}

export class EventLog {
  constructor(list, scroller = list.parentElement) {
    this.list = list;
    this.scroller = scroller;
  }

  apply(event) {
    const line = eventLine(event);
    if (line === null) return;
    const atBottom = this.scroller.scrollTop + this.scroller.clientHeight >= this.scroller.scrollHeight - 4;
    const item = document.createElement("li");
    item.textContent = line;
    item.dataset.seq = String(event.seq);
    item.dataset.kind = event.kind;
    this.list.appendChild(item);
    while (this.list.childElementCount > LOG_LIMIT) this.list.firstElementChild.remove();
    if (atBottom) this.scroller.scrollTop = this.scroller.scrollHeight;
  }
}
