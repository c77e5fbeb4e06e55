// The run page's chart panels (reward, policy, data, system), drawn with plotly.js served by this app from the plotly
// wheel. The stored metrics come from one request (runs.pages.run_page.run_metric_series); the run's events
// (run_page.js) then extend them in place. Redraws go through Plotly.react on the layout object plotly already holds,
// so a zoom or pan (by mouse or Plotly.relayout) survives new points; `uirevision` keeps legend toggles too.
// #run-chart is the reward panel, with the trace names bench/demo_learning.py and tests read; it and every other
// panel get data-ready="1" once the stored points are drawn.

const CONFIG = { displaylogo: false, responsive: true };

const PANELS = [
  {
    id: "run-chart", runTitle: true, yTitle: "reward / Pass@1",
    series: [  // keep these three first and named so: bench/demo_learning.py and the chart tests read them
      { metric: "reward/mean", label: "train reward (mean of the step)", color: "#7a7a7a", smooth: true,
        markers: 4, band: "reward/std", keep: true },
      { metric: "eval/pass@1", label: "val Pass@1 (mean of k samples)", color: "#5b3cc4", markers: 8, keep: true },
      { metric: "eval/pass@1_greedy", label: "val Pass@1 (greedy)", color: "#067647", dash: "dot", markers: 8,
        keep: true },
    ],
  },
  {
    id: "chart-policy", yTitle: "loss, entropy, grad norm", y2Title: "fraction / ratio / mismatch",
    series: [
      { metric: "loss/total", label: "loss", color: "#b42318", smooth: true },
      { metric: "actor/entropy", label: "entropy", color: "#1570ef", smooth: true },
      { metric: "actor/grad_norm", label: "grad norm", color: "#7a5af8", smooth: true },
      { metric: "actor/clip_frac", label: "clip fraction", color: "#f79009", smooth: true, axis: "y2" },
      { metric: "actor/ratio_mean", label: "importance ratio (mean)", color: "#0e9384", smooth: true, axis: "y2" },
      { metric: "is/weight_mean", label: "TIS weight (mean)", color: "#66c61c", smooth: true, axis: "y2" },
      { metric: "is/truncated_frac", label: "TIS truncated fraction", color: "#dd2590", smooth: true, axis: "y2" },
      { metric: "train/logprob_mismatch_mean", label: "engine–trainer |Δ logprob|", color: "#475467",
        smooth: true, axis: "y2" },
      { metric: "mismatch/kl", label: "engine–trainer KL", color: "#98a2b3", smooth: true, axis: "y2", dash: "dot" },
    ],
  },
  {
    id: "chart-data", yTitle: "tokens", y2Title: "count / fraction",
    series: [
      { metric: "length/completion_tokens_mean", label: "response length (tokens, mean)", color: "#1570ef",
        smooth: true },
      { metric: "length/sample_tokens_mean", label: "sample length (tokens, mean)", color: "#53b1fd", smooth: true,
        dash: "dot" },
      { metric: "length/context_tokens_mean", label: "context per call (prompt + completion, mean)", color: "#344054",
        smooth: true },
      { metric: "length/context_tokens_max", label: "context per call (max)", color: "#344054", dash: "dash" },
      { metric: "rollout/calls_mean", label: "calls per rollout", color: "#7a5af8", smooth: true, axis: "y2" },
      { metric: "train/samples", label: "samples per step", color: "#0e9384", smooth: true, axis: "y2" },
      { metric: "groups/with_signal", label: "groups with signal (rewards differ)", color: "#067647", axis: "y2" },
      { metric: "samples/dropped_rollouts", label: "dropped rollouts (no trained sample)", color: "#b42318",
        axis: "y2" },
      { metric: "rollout/policy_failures", label: "policy failures", color: "#f79009", axis: "y2" },
      // The reward script's own exceptions (left out of the loss) and the outcomes it declared unparseable
      // (UnparseableOutcome: trained as policy failures).
      { metric: "reward/script_errors", label: "reward script errors (not trained)", color: "#912018", axis: "y2",
        dash: "dash" },
      { metric: "reward/unparseable", label: "outcomes the reward script could not parse", color: "#dc6803",
        axis: "y2", dash: "dash" },
      { metric: "drift/clean_count", label: "drift: clean appends", color: "#98a2b3", axis: "y2", dash: "dot" },
      { metric: "drift/realign_count", label: "drift: realigns", color: "#dd2590", axis: "y2", dash: "dot" },
      { metric: "drift/fork_count", label: "drift: forks", color: "#6941c6", axis: "y2", dash: "dot" },
    ],
  },
  {
    // What GRPO can learn from: groups whose attempts scored differently. With dynamic sampling the trained share
    // stays up while the sampled share shows the policy going deterministic; without it both fall together.
    id: "chart-signal", yTitle: "groups / rollouts per step", y2Title: "share of groups with signal",
    series: [
      { metric: "groups/signal_share", label: "signal share (trained groups)", color: "#067647", markers: 6,
        axis: "y2" },
      { metric: "groups/sampled_signal_share", label: "signal share (all groups sampled)", color: "#b42318",
        markers: 6, axis: "y2", dash: "dot" },
      // Stacked, the three bars are the groups sampled.
      { metric: "groups/trained_with_signal", label: "groups trained with signal", color: "#12b76a", kind: "bar" },
      { derive: ["groups/trained", "groups/trained_with_signal"], fn: ([trained, kept]) => trained - kept,
        label: "groups trained without signal", color: "#d0d5dd", kind: "bar" },
      { metric: "groups/dropped_no_signal", label: "groups dropped (no signal, not trained)", color: "#f79009",
        kind: "bar" },
      { metric: "rollout/extra", label: "extra rollouts spent", color: "#98a2b3", dash: "dash" },
    ],
  },
  {
    id: "chart-system", yTitle: "seconds", y2Title: "tokens/s", y3Title: "staleness", split: true,
    series: [
      { metric: "time/generate", label: "generate", color: "#1570ef", kind: "bar" },
      { metric: "time/train", label: "train", color: "#b42318", kind: "bar" },
      { metric: "time/sync", label: "sync", color: "#f79009", kind: "bar" },
      { derive: ["time/build_samples", "time/checkpoint", "time/record"],
        fn: (parts) => parts.reduce((a, b) => a + b, 0),
        label: "samples, checkpoint, record", color: "#98a2b3", kind: "bar" },
      { metric: "time/idle", label: "idle", color: "#d0d5dd", kind: "bar" },
      { metric: "eval/seconds", label: "eval", color: "#5b3cc4", kind: "bar" },
      { metric: "rollout/generated_tokens_per_s", label: "generated tokens/s", color: "#0e9384", smooth: true,
        axis: "y2" },
      { metric: "train/tokens_per_s", label: "trained tokens/s", color: "#7a5af8", smooth: true, axis: "y2" },
      { metric: "staleness/mean", label: "staleness (mean)", color: "#dd2590", smooth: true, axis: "y3", dash: "dot" },
    ],
  },
];

export const METRIC_NAMES = [...new Set(PANELS.flatMap((p) => p.series.flatMap((s) =>
  s.derive ? s.derive : [s.metric, ...(s.band ? [s.band] : [])])))];

export class RunCharts {
  constructor(config) {
    this.runId = config.run;
    this.title = config.name || "";
    this.store = new Map();  // metric name -> Map(step -> {v: value, t: ISO time recorded})
    this.mode = "step";
    this.smoothing = 0;
    this.panels = PANELS.map((spec) => ({ spec, el: document.getElementById(spec.id), layout: null, mode: null }))
      .filter((panel) => panel.el);
    this.pending = false;
    this.bindControls();
  }

  bindControls() {
    const slider = document.getElementById("chart-smoothing");
    const shown = document.getElementById("chart-smoothing-value");
    slider?.addEventListener("input", () => {
      this.smoothing = Math.min(0.99, Math.max(0, Number(slider.value) || 0));
      if (shown) shown.textContent = this.smoothing.toFixed(2);
      this.draw();
    });
    for (const radio of document.querySelectorAll("input[name=chart-x]")) {
      radio.addEventListener("change", () => { if (radio.checked) { this.mode = radio.value; this.draw(); } });
    }
  }

  async load() {
    try {
      const query = `name=${encodeURIComponent(METRIC_NAMES.join(","))}`;
      const response = await fetch(`/runs/${this.runId}/series/?${query}`,
                                   { credentials: "same-origin", headers: { Accept: "application/json" } });
      if (!response.ok) throw new Error(`metrics of run ${this.runId}: HTTP ${response.status}`);
      const { metrics } = await response.json();
      for (const [name, series] of Object.entries(metrics)) {
        series.step.forEach((step, i) => this.set(name, step, series.value[i], series.t[i]));
      }
    } finally {
      await this.render();
      for (const panel of this.panels) panel.el.dataset.ready = "1";  // every stored point is drawn
    }
  }

  set(name, step, value, time) {
    if (!this.store.has(name)) this.store.set(name, new Map());
    this.store.get(name).set(step, { v: value, t: time });
  }

  apply(event) {
    if (event.kind === "run.metrics") {
      for (const [name, value] of Object.entries(event.payload.values || {})) {
        this.set(name, event.payload.step, value, event.created_at);
      }
      this.draw();
    } else if (event.kind === "run.resumed") {  // back to a checkpoint: later steps are trained again
      for (const byStep of this.store.values()) {
        for (const step of [...byStep.keys()]) if (step > event.payload.step) byStep.delete(step);
      }
      this.draw();
    }
  }

  draw() {  // a replay brings many events at once: one redraw per frame
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => { this.pending = false; this.render(); });
  }

  render() {
    return Promise.all(this.panels.map((panel) => {
      const fresh = panel.mode !== this.mode || !panel.el.layout;
      if (fresh) {
        panel.layout = layout(panel.spec, this.mode, panel.spec.runTitle ? this.title : "");
        panel.mode = this.mode;
      }
      // The layout plotly holds carries the user's zoom: hand it back unless the x axis itself changed.
      return window.Plotly.react(panel.el, this.traces(panel.spec), fresh ? panel.layout : panel.el.layout, CONFIG);
    }));
  }

  traces(spec) {
    const out = [];
    const bands = [];
    spec.series.forEach((series, index) => {
      const points = this.points(series);
      if (!points.length && !series.keep) return;
      const raw = points.map((p) => p.v);
      const y = series.smooth ? ema(raw, this.smoothing) : raw;
      const x = points.map((p) => (this.mode === "time" ? p.t : p.step));
      out.push(trace(series, `${spec.id}-${index}`, x, y));  // uid: plotly puts it in CSS selectors
      if (series.band) bands.push(...this.band(series, points, y));
    });
    return out.concat(bands);  // after the named traces: data[0] stays the train reward
  }

  points(series) {
    if (series.metric) {
      const byStep = this.store.get(series.metric) || new Map();
      return [...byStep.entries()].sort((a, b) => a[0] - b[0]).map(([step, p]) => ({ step, ...p }));
    }
    const first = this.store.get(series.derive[0]) || new Map();
    return [...first.entries()].sort((a, b) => a[0] - b[0]).map(([step, p]) => ({
      step, t: p.t, v: series.fn(series.derive.map((name) => this.store.get(name)?.get(step)?.v ?? 0)),
    }));
  }

  band(series, points, smoothedMean) {  // mean ± std, the std smoothed like the mean
    const std = this.store.get(series.band) || new Map();
    const rows = points.map((p, i) => ({ p, mean: smoothedMean[i], std: std.get(p.step)?.v }))
      .filter((row) => typeof row.std === "number");
    if (!rows.length) return [];
    const s = ema(rows.map((row) => row.std), series.smooth ? this.smoothing : 0);
    const x = rows.map((row) => (this.mode === "time" ? row.p.t : row.p.step));
    const common = { x, type: "scatter", mode: "lines", line: { width: 0 }, hoverinfo: "skip" };
    return [
      { ...common, uid: "band-low", name: "train reward − std", showlegend: false,
        y: rows.map((r, i) => r.mean - s[i]) },
      { ...common, uid: "band-high", name: "train reward ± std", y: rows.map((r, i) => r.mean + s[i]),
        fill: "tonexty", fillcolor: "rgba(122, 122, 122, 0.18)" },
    ];
  }
}

// Exponential moving average, debiased like TensorBoard's: the first point is the first value.
export function ema(values, alpha) {
  if (!alpha) return values;
  let sum = 0;
  let weight = 0;
  return values.map((value) => {
    sum = alpha * sum + (1 - alpha) * value;
    weight = alpha * weight + (1 - alpha);
    return sum / weight;
  });
}

function trace(series, uid, x, y) {
  const base = { uid, name: series.label, x, y, yaxis: series.axis || "y" };
  if (series.kind === "bar") return { ...base, type: "bar", marker: { color: series.color } };
  return {
    ...base, type: "scatter", mode: series.markers ? "lines+markers" : "lines",
    line: { color: series.color, dash: series.dash || "solid", width: 2 },
    marker: { size: series.markers || 4, color: series.color },
  };
}

function layout(spec, mode, title) {
  // Only the reward panel names its x axis: below the others' long legends the title would crowd them.
  const named = Boolean(spec.runTitle);
  const xaxis = mode === "time"
    ? { type: "date", title: { text: named ? "wall time" : "" } }
    : { title: { text: named ? "step (policy updates)" : "" } };
  const result = {
    uirevision: mode,  // a new x axis starts unzoomed; otherwise the user's zoom and legend clicks stay
    // Plotly reads a few HTML tags in titles: a run's name is shown as text, never markup.
    title: title ? { text: escapeHtml(title), font: { size: 15 } } : undefined,
    xaxis: { ...xaxis, zeroline: false, automargin: true },
    yaxis: { title: { text: spec.yTitle }, zeroline: false, automargin: true },
    barmode: "stack",
    legend: { orientation: "h", yanchor: "top", y: named ? -0.2 : -0.1 },
    margin: { l: 60, r: spec.y2Title ? 60 : 20, t: title ? 50 : 20, b: 90 },
    paper_bgcolor: "#fff", plot_bgcolor: "#fff", font: { family: "system-ui, sans-serif", size: 12 },
  };
  if (spec.split) {  // bars of step time above, throughput and staleness below, on one x axis
    result.xaxis.anchor = "y2";
    result.yaxis.domain = [0.45, 1];
    result.yaxis2 = { title: { text: spec.y2Title }, domain: [0, 0.33], anchor: "x", zeroline: false,
                      automargin: true };
    result.yaxis3 = { title: { text: spec.y3Title }, overlaying: "y2", side: "right", anchor: "x", zeroline: false,
                      automargin: true, showgrid: false };
  } else if (spec.y2Title) {
    result.yaxis2 = { title: { text: spec.y2Title }, overlaying: "y", side: "right", zeroline: false,
                      automargin: true, showgrid: false };
  }
  return result;
}

export function escapeHtml(text) {
  return text.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
}
