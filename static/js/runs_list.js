// The runs list, live: one websocket (/ws/runs/, through live.js) brings status, phase, metrics and resume events of
// every run the user sees. On every (re)connect the rows are backfilled from /runs/rows/ (same filters and page);
// then events newer than a row's event_seq update it in place. An event of a run not shown (a new run) triggers a
// debounced backfill. Everything from the server is set as text (textContent) or numbers, never as HTML.
import { connectLive } from "./live.js";
import { sparkline } from "./sparkline.js";

const REWARD = "reward/mean";
const PASS1 = "eval/pass@1";
const SPARK_POINTS = 50;
const BACKFILL_DELAY = 300;
const COMPARE_MAX = 8;
const ACTIVE = new Set(["queued", "starting", "running", "cancelling"]);
const TICKING = new Set(["starting", "running", "cancelling"]);

export function followRunsList(table) {
  const body = table.querySelector("tbody");
  const query = table.dataset.query || "";
  const page = table.dataset.page || "1";
  const statusFilter = new URLSearchParams(query).get("status") || "";
  const rows = new Map();   // run id -> { data, tr, since }
  const hidden = new Set(); // runs with events that the last backfill did not show (filtered out, other page)
  const selected = new Set();
  let buffer = null;        // events that arrive while a backfill is in flight
  let backfillTimer = null;

  let inflight = null;      // the backfill running now; asking again meanwhile runs one more after it
  let again = false;

  const fetchRows = async () => {
    const url = `/runs/rows/?${query}${query ? "&" : ""}page=${encodeURIComponent(page)}`;
    const response = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
    if (!response.ok) throw new Error(`runs rows: HTTP ${response.status}`);
    const data = await response.json();
    render(data.rows);
    document.getElementById("runs-count").textContent = `${data.count} run${data.count === 1 ? "" : "s"}`;
  };
  const backfill = () => {
    if (inflight) {
      again = true;
      return inflight;
    }
    inflight = (async () => {
      buffer = [];
      try {
        do {
          again = false;
          await fetchRows();
        } while (again);
        const waiting = buffer;
        buffer = null;
        for (const event of waiting) if (typeof event.run === "number" && !rows.has(event.run)) hidden.add(event.run);
        for (const event of waiting) apply(event);
      } finally {
        buffer = null;
        inflight = null;
      }
    })();
    return inflight;
  };
  const scheduleBackfill = () => {
    clearTimeout(backfillTimer);
    backfillTimer = setTimeout(() => backfill().catch((error) => console.warn("runs backfill failed", error)),
                               BACKFILL_DELAY);
  };

  const render = (list) => {
    rows.clear();
    const fresh = list.map((data) => {
      const tr = document.createElement("tr");
      tr.dataset.run = String(data.id);
      const entry = { data, tr, since: performance.now() };
      build(entry);
      rows.set(data.id, entry);
      return tr;
    });
    for (const id of [...selected]) if (!rows.has(id)) selected.delete(id);
    if (!fresh.length) {
      const tr = document.createElement("tr");
      tr.className = "none";
      const td = cell(tr, "muted", query ? "No runs match these filters." : "No runs yet.");
      td.colSpan = 12;
      fresh.push(tr);
    }
    body.replaceChildren(...fresh);
    for (const id of rows.keys()) hidden.delete(id);
    updateSelection();
  };

  const build = (entry) => {
    const { data, tr } = entry;
    const check = document.createElement("input");
    check.type = "checkbox";
    check.name = "ids";
    check.value = String(data.id);
    check.setAttribute("form", "bulk");
    check.setAttribute("aria-label", `select run ${data.id}`);
    check.checked = selected.has(data.id);
    check.addEventListener("change", () => {
      if (check.checked) selected.add(data.id); else selected.delete(data.id);
      updateSelection();
    });
    cell(tr, "sel").appendChild(check);
    const name = cell(tr, "name");
    const link = document.createElement("a");
    link.href = data.url;
    link.textContent = data.name;
    const phase = document.createElement("small");
    phase.className = "phase muted";
    name.append(link, phase);
    const state = cell(tr, "state");
    const alarms = Object.assign(document.createElement("a"), { className: "alarm-badge", href: `${data.url}#health`,
                                                                 title: "health alarms not acknowledged" });
    alarms.append("⚠ ", Object.assign(document.createElement("span"), { className: "alarm-count" }));
    state.append(document.createElement("span"), " ", alarms);
    const progress = cell(tr, "progress");
    progress.append(document.createElement("progress"), " ", Object.assign(document.createElement("span"),
                                                                                { className: "step" }));
    for (const name of ["elapsed", "reward num", "pass1 num", "spark"]) cell(tr, name);
    cell(tr, "harness", data.harness);
    cell(tr, "dataset", data.dataset);
    cell(tr, "model", data.model);
    cell(tr, "created", data.created).title = data.created_at;
    update(entry);
  };

  const update = (entry) => {
    const { data, tr } = entry;
    const badge = tr.querySelector(".state span");
    badge.className = `status status-${data.status}`;
    badge.textContent = data.status;
    const alarms = tr.querySelector(".alarm-badge");
    if (alarms) {
      alarms.hidden = !data.alarms;
      alarms.querySelector(".alarm-count").textContent = String(data.alarms || 0);
    }
    tr.querySelector(".phase").textContent = ACTIVE.has(data.status) ? data.phase || "" : "";
    const bar = tr.querySelector("progress");
    bar.max = data.steps || 1;
    bar.value = Math.min(data.step, data.steps || 1);
    tr.querySelector(".step").textContent = `${data.step}/${data.steps ?? "?"}`;
    tr.querySelector(".reward").textContent = number(data.reward);
    tr.querySelector(".pass1").textContent = number(data.pass1);
    tr.querySelector(".spark").replaceChildren(sparkline(data.spark, { label: REWARD }));
    tick(entry, performance.now());
  };

  const tick = (entry, now) => {
    const { data } = entry;
    const seconds = data.elapsed_s == null ? null
      : data.elapsed_s + (data.ticking ? (now - entry.since) / 1000 : 0);
    entry.tr.querySelector(".elapsed").textContent = duration(seconds);
  };

  const apply = (event) => {
    if (buffer) {
      buffer.push(event);
      return;
    }
    if (typeof event.run !== "number") return;  // feed.joined
    const entry = rows.get(event.run);
    if (!entry) {
      if (!hidden.has(event.run) || event.kind === "run.status") scheduleBackfill();
      return;
    }
    const { data } = entry;
    if (event.seq <= data.event_seq) return;
    data.event_seq = event.seq;
    const payload = event.payload || {};
    const now = performance.now();
    if (event.kind === "run.status") {
      freeze(entry, now);
      data.status = payload.status;
      if (data.status === "running" && data.elapsed_s == null) data.elapsed_s = 0;  // started_at is set now
      data.ticking = TICKING.has(data.status) && data.elapsed_s != null;
      if (statusFilter && data.status !== statusFilter) scheduleBackfill();  // it leaves this filtered list
    } else if (event.kind === "run.phase") {
      data.phase = payload.phase || "";
    } else if (event.kind === "run.metrics") {
      const values = payload.values || {};
      data.step = Math.max(data.step, payload.step);
      if (REWARD in values) {
        data.reward = values[REWARD];
        data.spark = data.spark.filter(([step]) => step !== payload.step).concat([[payload.step, values[REWARD]]])
          .sort((a, b) => a[0] - b[0]).slice(-SPARK_POINTS);
      }
      if (PASS1 in values) data.pass1 = values[PASS1];
    } else if (event.kind === "run.alarm") {  // raised (+1) or acknowledged (-1): health.services
      data.alarms = Math.max(0, (data.alarms || 0) + (payload.acknowledged ? -1 : 1));
    } else if (event.kind === "run.resumed") {  // back to a checkpoint: later points are dropped and redone
      data.step = payload.step;
      data.spark = data.spark.filter(([step]) => step <= payload.step);
      scheduleBackfill();
    }
    update(entry);
  };

  const freeze = (entry, now) => {  // keep the elapsed time counted so far when ticking stops or starts
    if (entry.data.ticking && entry.data.elapsed_s != null) entry.data.elapsed_s += (now - entry.since) / 1000;
    entry.since = now;
  };

  const compare = document.getElementById("compare-selected");
  const cancel = document.getElementById("cancel-selected");
  const count = document.getElementById("selected-count");
  const updateSelection = () => {
    const ids = [...selected].filter((id) => rows.has(id));
    compare.disabled = ids.length < 2 || ids.length > COMPARE_MAX;
    cancel.disabled = ids.length === 0;
    count.textContent = ids.length ? `${ids.length} selected` : "";
  };
  compare.addEventListener("click", () => {
    const ids = [...selected].filter((id) => rows.has(id));  // in the order they were picked
    if (ids.length >= 2) location.assign(`/runs/compare/?ids=${ids.join(",")}`);
  });
  // The server-rendered rows are replaced by the first backfill; until then their checkboxes count too.
  for (const check of body.querySelectorAll("input[name=ids]")) {
    check.addEventListener("change", () => {
      const id = Number(check.value);
      if (check.checked) selected.add(id); else selected.delete(id);
      compare.disabled = selected.size < 2 || selected.size > COMPARE_MAX;
      cancel.disabled = selected.size === 0;
    });
  }

  const filters = document.getElementById("run-filters");  // a chosen status, harness or dataset applies at once
  for (const select of filters?.querySelectorAll("select") || []) {
    select.addEventListener("change", () => filters.requestSubmit());
  }

  setInterval(() => {
    const now = performance.now();
    for (const entry of rows.values()) if (entry.data.ticking) tick(entry, now);
  }, 1000);
  table.dataset.live = "1";
  return connectLive("/ws/runs/", { onOpen: backfill, onEvent: apply });
}

function cell(tr, className, text) {
  const td = document.createElement("td");
  td.className = className;
  if (text !== undefined) td.textContent = text;
  tr.appendChild(td);
  return td;
}

function number(value) {
  return typeof value === "number" ? value.toFixed(3) : "—";
}

export function duration(seconds) {  // as runs.run_summaries.format_seconds
  if (seconds == null) return "—";
  const s = Math.floor(seconds);
  const pad = (n) => String(n).padStart(2, "0");
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${pad(s % 60)}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${pad(Math.floor((s % 3600) / 60))}m`;
  return `${Math.floor(s / 86400)}d ${pad(Math.floor((s % 86400) / 3600))}h`;
}
