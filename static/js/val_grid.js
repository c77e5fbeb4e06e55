// The run page's validation grid (val tasks by evaluations) and list of trained steps, from runs.pages.run_inspect
// (run-val-grid, run-steps). run_page.js feeds them the run's events: an evaluation's run.metrics (eval/* values)
// reloads the grid, a step's adds it to the list. Text, never HTML.
const FLAGS = ["flipped", "fail_to_pass", "pass_to_fail", "never_solved"];
const SENTINEL = "999999999";  // the task / step id the templates reversed their URL patterns with
const STEP_METRICS = [["reward/mean", "reward"], ["groups/with_signal", "groups with signal"],
  ["samples/dropped_rollouts", "dropped"]];

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

function isEval(payload) {
  return Object.keys(payload?.values || {}).some((name) => name.startsWith("eval/"));
}

export class ValGrid {
  constructor(section, lastSeq = 0) {
    this.section = section;
    this.lastSeq = lastSeq;  // the page loads the grid as of this event; older (replayed) ones change nothing
    this.url = section.dataset.url;
    this.runId = section.dataset.url.split("/").filter(Boolean)[1];
    this.compareTemplate = section.dataset.compareTemplate || "";
    this.filter = document.getElementById("val-grid-filter");
    this.sort = document.getElementById("val-grid-sort");
    this.grid = null;
    this.loading = null;
    this.filter.addEventListener("change", () => this.render());
    this.sort.addEventListener("change", () => this.render());
  }

  apply(event) {
    if (event.seq <= this.lastSeq) return;
    if (!((event.kind === "run.metrics" && isEval(event.payload)) || event.kind === "run.resumed")) return;
    if (this.loading) this.again = true;  // the grid read now may predate this event: read it once more after
    else this.load();
  }

  async load() {
    this.loading = fetch(this.url, { headers: { Accept: "application/json" } });
    try {
      const response = await this.loading;
      if (!response.ok) throw new Error(`${response.status}`);
      this.grid = await response.json();
      this.render();
    } catch (error) {
      console.error("validation grid not loaded", error);
    } finally {
      this.loading = null;
      if (this.again) {
        this.again = false;
        this.load();
      }
    }
  }

  compareUrl(taskId, a, b) {
    // val-task-compare where it is registered (the template reversed it), its agreed path where it is not
    const base = this.compareTemplate
      ? this.compareTemplate.replace(SENTINEL, String(taskId))
      : `/runs/${this.runId}/val/${taskId}/`;
    return `${base}?a=${encodeURIComponent(a)}&b=${encodeURIComponent(b)}`;
  }

  rows() {
    const tasks = [...this.grid.tasks];
    const wanted = this.filter.value;
    const shown = wanted === "all" ? tasks : tasks.filter((t) => t[wanted]);
    const lastScore = (t) => {
      for (let i = t.cells.length - 1; i >= 0; i -= 1) {
        const c = t.cells[i];
        if (c && c.pass_fraction !== null) return c.pass_fraction;
        if (c && c.greedy !== null) return c.greedy ? 1 : 0;
      }
      return -1;
    };
    const solved = (t) => t.states.filter((s) => s === "pass" || s === "partial").length;
    const flips = (t) => {
      const seen = t.states.filter((s) => s !== "missing").map((s) => s !== "fail");
      return seen.slice(1).filter((s, i) => s !== seen[i]).length;
    };
    const keys = {
      index: (t) => t.index, task: (t) => t.external_id, last: lastScore, "-last": (t) => -lastScore(t),
      solved, flips: (t) => -flips(t),
    };
    const key = keys[this.sort.value] || keys.index;
    return shown.sort((x, y) => {
      const a = key(x), b = key(y);
      if (a < b) return -1;
      if (a > b) return 1;
      return x.index - y.index;
    });
  }

  render() {
    if (!this.grid) return;
    const { steps, tasks, counts } = this.grid;
    document.getElementById("val-grid-empty").hidden = tasks.length > 0;
    for (const option of this.filter.options) {
      const n = counts?.[option.value];
      option.textContent = `${option.textContent.replace(/ \(\d+\)$/, "")} (${n ?? 0})`;
    }
    const head = document.getElementById("val-grid-head");
    head.replaceChildren(el("th", "", "Task"), ...steps.map((s) => {
      const th = el("th", "num", `step ${s}`);
      th.dataset.step = s;
      return th;
    }), el("th", "", "Flags"));
    const body = document.getElementById("val-grid-body");
    const rows = this.rows();
    body.replaceChildren(...rows.map((task) => this.row(task, steps)));
    document.getElementById("val-grid-count").textContent =
      `${rows.length} of ${tasks.length} val tasks · ${steps.length} evaluation${steps.length === 1 ? "" : "s"}`;
    this.section.dataset.rendered = String(rows.length);
  }

  row(task, steps) {
    const tr = el("tr", "val-row");
    tr.dataset.taskId = task.task;
    tr.dataset.externalId = task.external_id;
    for (const flag of FLAGS) if (task[flag]) tr.classList.add(`val-${flag.replace(/_/g, "-")}`);
    const name = el("th", "val-task");
    const evaluated = steps.filter((_, i) => task.states[i] !== "missing");
    const a = evaluated.length ? evaluated[0] : steps[0];
    const b = evaluated.length ? evaluated[evaluated.length - 1] : steps[steps.length - 1];
    const link = el("a", "val-task-link", task.external_id);
    link.href = this.compareUrl(task.task, a, b);
    link.title = `trajectories at step ${a} and step ${b}, side by side`;
    name.append(link);
    tr.append(name);
    task.cells.forEach((cell, i) => {
      const td = el("td", `val-cell ${task.states[i]}`, task.texts[i]);
      td.dataset.step = steps[i];
      if (cell) {
        td.title = `step ${steps[i]}: ${cell.passed}/${cell.attempts} sampled attempts passed`
          + (cell.greedy === null ? "" : `, greedy ${cell.greedy ? "passed" : "failed"}`)
          + (cell.infra_failures ? `, ${cell.infra_failures} lost to infrastructure` : "")
          + (cell.unscored ? `, ${cell.unscored} still running` : "");
        if (cell.greedy !== null) {
          const dot = el("span", `greedy-mark ${cell.greedy ? "greedy-pass" : "greedy-fail"}`,
            cell.greedy ? "●" : "○");
          td.append(dot);
        }
      }
      tr.append(td);
    });
    const flags = el("td", "val-flags");
    for (const flag of FLAGS) if (task[flag]) flags.append(el("span", `flag flag-${flag}`, flag.replace(/_/g, " ")));
    tr.append(flags);
    return tr;
  }
}

export class StepList {
  constructor(section) {
    this.section = section;
    this.url = section.dataset.url;
    this.template = section.dataset.stepTemplate;
    this.list = document.getElementById("step-list");
    this.steps = new Map();  // step -> metrics
  }

  apply(event) {
    const { kind, payload } = event;
    if (kind === "run.metrics" && payload.step >= 1 && !isEval(payload)) {
      this.steps.set(payload.step, { ...(this.steps.get(payload.step) || {}), ...payload.values });
      this.render();
    } else if (kind === "run.resumed") {
      for (const step of [...this.steps.keys()]) if (step > payload.step) this.steps.delete(step);
      this.render();
    }
  }

  async load() {
    try {
      const response = await fetch(this.url, { headers: { Accept: "application/json" } });
      if (!response.ok) throw new Error(`${response.status}`);
      const body = await response.json();
      for (const { step, metrics } of body.steps) this.steps.set(step, { ...metrics, ...(this.steps.get(step) || {}) });
      this.render();
    } catch (error) {
      console.error("steps not loaded", error);
    }
  }

  render() {
    const steps = [...this.steps.keys()].sort((a, b) => b - a);
    document.getElementById("steps-empty").hidden = steps.length > 0;
    document.getElementById("steps-count").textContent = steps.length ? `${steps.length} trained` : "";
    this.list.replaceChildren(...steps.map((step) => {
      const li = el("li", "step-item");
      li.dataset.step = step;
      const link = el("a", "step-link", `step ${step}`);
      link.href = this.template.replace(SENTINEL, String(step));
      li.append(link);
      const metrics = this.steps.get(step);
      const parts = STEP_METRICS.filter(([name]) => typeof metrics[name] === "number")
        .map(([name, label]) => {
          const value = metrics[name];
          return `${label} ${Number.isInteger(value) ? value : value.toFixed(3)}`;
        });
      if (parts.length) li.append(el("span", "muted", ` · ${parts.join(" · ")}`));
      return li;
    }));
  }
}

export function startValGrid(config = {}) {
  const section = document.getElementById("validation");
  const stepsSection = document.getElementById("steps");
  const parts = [];
  if (section) parts.push(new ValGrid(section, config.last_seq || 0));
  if (stepsSection) parts.push(new StepList(stepsSection));
  for (const part of parts) part.load();
  return parts;
}
