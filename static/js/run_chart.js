// The run page's learning curve: train reward per step and validation Pass@1 per evaluation, drawn with plotly.js
// (served by this app from the plotly wheel). Loads the stored metrics over the REST API, then follows the
// "run-event" events that run_events.js re-dispatches from the run's websocket.
const SERIES = [
  { name: "reward/mean", label: "train reward (mean of the step)", color: "#9e9e9e", dash: "solid" },
  { name: "eval/pass@1", label: "val Pass@1 (mean of k samples)", color: "#5b3cc4", dash: "solid" },
  { name: "eval/pass@1_greedy", label: "val Pass@1 (greedy)", color: "#067647", dash: "dot" },
];

export async function chartRun(runId, element, title = "") {
  const points = new Map(SERIES.map((s) => [s.name, new Map()]));  // metric name -> step -> value
  const render = () => window.Plotly.react(element, traces(points), layout(title),
                                           { displaylogo: false, responsive: true });
  let pending = false;
  const draw = () => {  // a replay brings many events at once: one redraw per frame
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => { pending = false; render(); });
  };
  document.addEventListener("run-event", ({ detail: event }) => {
    if (event.kind === "run.metrics") {
      for (const [name, value] of Object.entries(event.payload.values || {})) {
        if (points.has(name)) points.get(name).set(event.payload.step, value);
      }
      draw();
    } else if (event.kind === "run.resumed") {  // back to a checkpoint: later steps are trained again
      for (const byStep of points.values()) {
        for (const step of [...byStep.keys()]) if (step > event.payload.step) byStep.delete(step);
      }
      draw();
    }
  });
  try {
    await load(runId, points);
  } finally {
    await render();
    element.dataset.ready = "1";  // every stored point is drawn (bench/demo_learning.py waits for this)
  }
}

async function load(runId, points) {
  const query = SERIES.map((s) => `name=${encodeURIComponent(s.name)}`).join("&");
  let url = `/api/v1/runs/${runId}/metrics/?${query}`;
  while (url) {
    const response = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
    if (!response.ok) throw new Error(`metrics of run ${runId}: HTTP ${response.status}`);
    const page = await response.json();
    for (const row of page.results) points.get(row.name)?.set(row.step, row.value);
    url = page.next;
  }
}

function traces(points) {
  return SERIES.map((s) => {
    const steps = [...points.get(s.name).keys()].sort((a, b) => a - b);
    return {
      name: s.label, x: steps, y: steps.map((step) => points.get(s.name).get(step)),
      type: "scatter", mode: "lines+markers", line: { color: s.color, dash: s.dash, width: 2 },
      marker: { size: s.name === "reward/mean" ? 4 : 8 },
    };
  });
}

function layout(title) {
  return {
    // Plotly reads a few HTML tags in titles: a run's name is shown as text, never markup.
    title: title ? { text: escapeHtml(title), font: { size: 15 } } : undefined,
    xaxis: { title: { text: "step (policy updates)" }, rangemode: "tozero", zeroline: false },
    yaxis: { title: { text: "reward / Pass@1" }, rangemode: "tozero", zeroline: false },
    legend: { orientation: "h", y: -0.22 },
    margin: { l: 60, r: 20, t: title ? 50 : 20, b: 80 },
    paper_bgcolor: "#fff", plot_bgcolor: "#fff", font: { family: "system-ui, sans-serif", size: 12 },
  };
}

function escapeHtml(text) {
  return text.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
}
