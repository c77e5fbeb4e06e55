// The run page's rollouts table: one page of rollouts at a time from runs.pages.run_page.run_rollouts (filtered,
// sorted and paged in SQL), built with textContent. Rollout events refresh the page shown, at most once a second.
const REFRESH_EVERY_MS = 1000;
const REFRESH_KINDS = new Set(["rollout.status", "call.recorded", "run.resumed", "run.status"]);

export class RolloutsTable {
  constructor(root) {
    this.root = root;
    this.url = root.dataset.url;
    this.form = root.querySelector("#rollouts-filter");
    this.exportLink = root.querySelector("#export-rollouts");
    this.exportUrl = this.exportLink ? this.exportLink.getAttribute("href").split("?")[0] : "";
    this.body = root.querySelector("#rollouts-body");
    this.sort = "newest";
    this.page = 1;
    this.lastFetch = 0;
    this.timer = null;
    this.inFlight = false;
    this.again = false;
    this.loads = 0;
    this.bind();
  }

  bind() {
    let typing = null;
    this.form.addEventListener("input", (event) => {
      this.updateExport();
      clearTimeout(typing);
      typing = setTimeout(() => { this.page = 1; this.refresh(); }, event.target.type === "search" ? 300 : 150);
    });
    this.form.addEventListener("submit", (event) => { event.preventDefault(); this.page = 1; this.refresh(); });
    for (const button of this.root.querySelectorAll("button.sort")) {
      button.addEventListener("click", () => {  // first click: highest first; again: lowest first
        const key = button.dataset.sort;
        this.sort = this.sort === `-${key}` ? key : `-${key}`;
        this.page = 1;
        this.refresh();
      });
    }
    this.root.querySelector("#rollouts-prev").addEventListener("click", () => { this.page -= 1; this.refresh(); });
    this.root.querySelector("#rollouts-next").addEventListener("click", () => { this.page += 1; this.refresh(); });
  }

  apply(event) {
    if (REFRESH_KINDS.has(event.kind)) this.schedule();
  }

  schedule() {  // debounced: at most one refresh a second, and never two in flight
    if (this.timer) return;
    const wait = Math.max(0, this.lastFetch + REFRESH_EVERY_MS - Date.now());
    this.timer = setTimeout(() => { this.timer = null; this.refresh(); }, wait);
  }

  filters() {
    const params = new URLSearchParams();
    for (const [name, value] of new FormData(this.form)) if (String(value).trim()) params.set(name, value);
    return params;
  }

  updateExport() {  // the export holds what the filters keep (sort and page do not apply to it)
    if (!this.exportLink) return;
    const filters = this.filters().toString();
    this.exportLink.href = filters ? `${this.exportUrl}?${filters}` : this.exportUrl;
  }

  params() {
    const params = this.filters();
    params.set("sort", this.sort);
    params.set("page", String(Math.max(1, this.page)));
    return params;
  }

  async refresh() {
    this.updateExport();
    if (this.inFlight) { this.again = true; return; }
    this.inFlight = true;
    this.lastFetch = Date.now();
    try {
      const response = await fetch(`${this.url}?${this.params()}`,
                                   { credentials: "same-origin", headers: { Accept: "application/json" } });
      const body = await response.json();
      this.showError(response.ok ? "" : body.error || `HTTP ${response.status}`);
      if (response.ok) this.render(body);
    } catch (error) {
      this.showError(`could not load the rollouts: ${error.message}`);
    } finally {
      this.inFlight = false;
      this.loads += 1;
      this.root.dataset.loads = String(this.loads);  // tests wait on this
      if (this.again) { this.again = false; this.schedule(); }
    }
  }

  showError(message) {
    const line = this.root.querySelector("#rollouts-error");
    line.textContent = message;
    line.hidden = !message;
  }

  render(body) {
    this.page = body.page;
    const shown = JSON.stringify(body);
    if (shown === this.shown) return;  // unchanged: keep the rows (and a click or selection on them)
    this.shown = shown;
    this.body.replaceChildren(...body.results.map(row));
    if (!body.results.length) {
      const empty = document.createElement("tr");
      const cell = cellOf(body.count ? "" : "No rollouts yet.", "muted");
      cell.colSpan = 10;
      empty.appendChild(cell);
      this.body.appendChild(empty);
    }
    this.root.querySelector("#rollouts-count").textContent = `${body.count} rollout${body.count === 1 ? "" : "s"}`;
    this.root.querySelector("#rollouts-page").textContent = `page ${body.page} of ${body.pages}`;
    this.root.querySelector("#rollouts-prev").disabled = body.page <= 1;
    this.root.querySelector("#rollouts-next").disabled = body.page >= body.pages;
    for (const button of this.root.querySelectorAll("button.sort")) {
      const key = button.dataset.sort;
      button.dataset.active = body.sort === key ? "asc" : body.sort === `-${key}` ? "desc" : "";
    }
  }
}

function row(rollout) {
  const tr = document.createElement("tr");
  tr.dataset.rollout = String(rollout.id);
  const link = document.createElement("a");
  link.href = `/rollouts/${rollout.id}/`;
  link.textContent = `#${rollout.id}`;
  const first = document.createElement("td");
  first.appendChild(link);
  const status = document.createElement("span");
  status.className = `status status-${rollout.status}`;
  status.textContent = rollout.failure_kind ? `${rollout.status} (${rollout.failure_kind})` : rollout.status;
  const statusCell = document.createElement("td");
  statusCell.appendChild(status);
  for (const flag of rollout.flags || []) {  // the reward-hacking lens (health.audit)
    const badge = document.createElement("span");
    badge.className = "flag-badge";
    badge.textContent = `⚑ ${String(flag.kind).replace(/_/g, " ")}`;
    badge.title = flag.evidence || "";
    statusCell.append(" ", badge);
  }
  const error = cellOf(rollout.error, "error");
  error.title = rollout.error;
  tr.append(
    first,
    cellOf(String(rollout.step)),
    cellOf(rollout.greedy ? `${rollout.split} (greedy)` : rollout.split),
    cellOf(`${rollout.group} · ${rollout.attempt}`),
    cellOf(rollout.task),
    statusCell,
    cellOf(rollout.reward === null ? "–" : formatReward(rollout.reward), "num"),
    cellOf(rollout.duration_s === null ? "–" : `${rollout.duration_s.toFixed(1)} s`, "num"),
    cellOf(String(rollout.calls), "num"),
    error,
  );
  return tr;
}

function cellOf(text, className = "") {
  const td = document.createElement("td");
  td.textContent = text;
  if (className) td.className = className;
  return td;
}

function formatReward(value) {
  return Number.isInteger(value) ? String(value) : value.toFixed(3);
}
