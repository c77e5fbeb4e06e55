// The comparison page's charts: one plotly chart a metric, one trace a run (in the run's colour of the legend above).
// Run and metric names reach plotly escaped: it reads a few HTML tags in titles, legends and hover labels.
// A series comes as {x: "steps", y: "values"} joined by commas by the database (runs.run_summaries.metric_series).
// Live: the runs feed (/ws/runs/) brings each compared run's new metric points; after every (re)connect the page
// reloads its series (?format=json), so points recorded while it was offline are drawn too.
import { connectLive } from "./live.js";

export function drawComparison(data, charts) {
  const store = new Map();  // metric -> run id -> step -> value
  const load = ({ series }) => {
    for (const [name, byRun] of Object.entries(series)) {
      for (const [runId, xy] of Object.entries(byRun)) {
        const { x, y } = points(xy);
        const steps = cell(store, name, Number(runId));
        x.forEach((step, i) => steps.set(step, y[i]));
      }
    }
  };
  const render = () => {
    for (const element of charts) {
      const name = element.dataset.metric;
      const eval_ = name.startsWith("eval/");
      const traces = data.runs.filter((run) => store.get(name)?.get(run.id)?.size).map((run) => {
        const steps = [...store.get(name).get(run.id).entries()].sort((a, b) => a[0] - b[0]);
        return {
          name: escapeHtml(`${run.name} (#${run.id})`), x: steps.map((p) => p[0]), y: steps.map((p) => p[1]),
          type: "scatter", mode: eval_ ? "lines+markers" : "lines",
          line: { color: run.color, width: 2 }, marker: { size: 6 },
        };
      });
      // uirevision: a redraw keeps the user's zoom
      window.Plotly.react(element, traces, { ...layout(name), uirevision: name }, { displaylogo: false, responsive: true });
      element.dataset.traces = String(traces.length);
    }
  };
  let pending = false;
  const draw = () => {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => { pending = false; render(); });
  };
  load(data);
  render();
  document.body.dataset.chartsReady = "1";
  const compared = new Set(data.runs.map((run) => run.id));
  connectLive("/ws/runs/", {
    onOpen: async () => {
      const response = await fetch(`${location.pathname}${location.search}&format=json`,
                                   { credentials: "same-origin", headers: { Accept: "application/json" } });
      if (!response.ok) throw new Error(`comparison series: HTTP ${response.status}`);
      load(await response.json());
      draw();
    },
    onEvent: (event) => {
      if (!compared.has(event.run)) return;
      if (event.kind === "run.metrics") {
        for (const [name, value] of Object.entries(event.payload.values || {})) {
          if (store.has(name)) cell(store, name, event.run).set(event.payload.step, value);
        }
        draw();
      } else if (event.kind === "run.resumed") {  // back to a checkpoint: its later points are trained again
        for (const byRun of store.values()) {
          const steps = byRun.get(event.run);
          for (const step of [...(steps?.keys() || [])]) if (step > event.payload.step) steps.delete(step);
        }
        draw();
      }
    },
  });
}

function cell(store, name, runId) {
  if (!store.has(name)) store.set(name, new Map());
  const byRun = store.get(name);
  if (!byRun.has(runId)) byRun.set(runId, new Map());
  return byRun.get(runId);
}

export function points({ x, y }) {
  const xs = x.split(",").map(Number);
  const ys = y.split(",").map(Number);
  const order = xs.map((_, i) => i).sort((a, b) => xs[a] - xs[b]);
  return { x: order.map((i) => xs[i]), y: order.map((i) => ys[i]) };
}

function layout(name) {
  return {
    title: { text: escapeHtml(name), font: { size: 13 } },
    xaxis: { title: { text: "step" }, zeroline: false },
    yaxis: { zeroline: false },
    showlegend: false, hovermode: "x unified",
    margin: { l: 50, r: 16, t: 36, b: 40 },
    paper_bgcolor: "#fff", plot_bgcolor: "#fff", font: { family: "system-ui, sans-serif", size: 11 },
  };
}

function escapeHtml(text) {
  return String(text).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
}
