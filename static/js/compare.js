// The comparison page's charts: one plotly chart a metric, one trace a run (in the run's colour of the legend above).
// Run and metric names reach plotly escaped: it reads a few HTML tags in titles, legends and hover labels.
// A series comes as {x: "steps", y: "values"} joined by commas by the database (runs.run_summaries.metric_series).
export function drawComparison({ runs, series }, charts) {
  for (const element of charts) {
    const name = element.dataset.metric;
    const byRun = series[name] || {};
    const eval_ = name.startsWith("eval/");
    const traces = runs.filter((run) => byRun[run.id]).map((run) => ({
      name: escapeHtml(`${run.name} (#${run.id})`),
      ...points(byRun[run.id]),
      type: "scatter", mode: eval_ ? "lines+markers" : "lines",
      line: { color: run.color, width: 2 }, marker: { size: 6 },
    }));
    window.Plotly.newPlot(element, traces, layout(name), { displaylogo: false, responsive: true });
    element.dataset.traces = String(traces.length);
  }
  document.body.dataset.chartsReady = "1";
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
