// A training step's rollout timeline as SVG: one bar per rollout (launch to reward, [data-rollout]) coloured by reward,
// over bands of the run's phases (generate, train, sync, eval...). The bars that finished last are outlined: they
// held the step up. Data from runs.inspect_queries.step_data (the page config). Text only through textContent.
const SVG = "http://www.w3.org/2000/svg";
const WIDTH = 1000;
const LEFT = 70;  // room for the row labels
const TOP = 34;  // room for the band labels
const AXIS = 26;
const BAND_COLOURS = { generate: "#d1e9ff", train: "#fee4e2", sync: "#fef0c7", eval: "#ebe9fe",
  checkpoint: "#d3f8df", record: "#f2f4f7", other: "#f2f4f7" };

function node(tag, attrs = {}, text) {
  const n = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, String(v));
  if (text !== undefined) n.textContent = String(text);
  return n;
}

export function rewardColour(reward, low, high) {
  if (reward === null || reward === undefined) return "#98a2b3";
  const t = high > low ? (reward - low) / (high - low) : 1;
  const hue = Math.round(4 + t * 136);  // red (low) to green (high)
  return `hsl(${hue}, 65%, 45%)`;
}

export function drawTimeline(container, config) {
  const { bars, bands, window: span } = config.timeline;
  if (!bars.length && !bands.length) {
    const empty = Object.assign(document.createElement("p"), { className: "muted", textContent: "Nothing to draw." });
    container.replaceChildren(empty);
    return;
  }
  const times = [...bars.flatMap((b) => [b.start, b.end]), ...bands.flatMap((b) => [b.start, b.end]),
    span.start, span.end].filter(Boolean).map((t) => Date.parse(t));
  const t0 = Math.min(...times);
  const t1 = Math.max(...times, t0 + 1);
  const rowHeight = bars.length > 80 ? Math.max(3, Math.floor(1200 / bars.length)) : 16;
  const height = TOP + bars.length * rowHeight + AXIS + 4;
  const x = (t) => LEFT + ((Date.parse(t) - t0) / (t1 - t0)) * (WIDTH - LEFT - 10);
  const svg = node("svg", { viewBox: `0 0 ${WIDTH} ${height}`, width: "100%", role: "img",
    "aria-label": `timeline of step ${config.step}` });
  svg.classList.add("timeline-svg");
  const bottom = TOP + bars.length * rowHeight;

  const bandLayer = node("g", { class: "bands" });
  const labelLayer = node("g", { class: "band-labels" });  // above every band and bar, so none hides a label
  bands.forEach((band, i) => {
    const start = x(band.start);
    const end = band.end ? x(band.end) : x(new Date(t1).toISOString());
    const g = node("g", { class: `band band-${band.kind}`, "data-kind": band.kind });
    g.append(node("rect", { x: start, y: 0, width: Math.max(1, end - start), height: bottom,
      fill: BAND_COLOURS[band.kind] || BAND_COLOURS.other }));
    labelLayer.append(node("text", { x: start + 2, y: 12 + (i % 2) * 13, class: "band-label" }, band.name));
    g.append(node("title", {}, `${band.name}: ${band.start} – ${band.end || "…"}`));
    bandLayer.append(g);
  });
  svg.append(bandLayer);

  const rewards = bars.map((b) => b.reward).filter((r) => r !== null && r !== undefined);
  const low = rewards.length ? Math.min(...rewards) : 0;
  const high = rewards.length ? Math.max(...rewards) : 1;
  const barLayer = node("g", { class: "bars" });
  bars.forEach((bar, i) => {
    const y = TOP + i * rowHeight;
    const start = x(bar.start);
    const end = bar.end ? x(bar.end) : WIDTH - 10;
    const g = node("g", { class: `bar${bar.straggler ? " straggler" : ""}${bar.dropped ? " dropped" : ""}`,
      "data-rollout": bar.rollout, "data-group": bar.group });
    const rect = node("rect", { x: start, y: y + 1, width: Math.max(2, end - start), height: Math.max(2, rowHeight - 2),
      fill: rewardColour(bar.reward, low, high) });
    if (bar.straggler) rect.setAttribute("stroke", "#101828");
    g.append(rect);
    if (rowHeight >= 12) g.append(node("text", { x: LEFT - 4, y: y + rowHeight - 4, "text-anchor": "end",
      class: "bar-label" }, `g${bar.group}·${bar.attempt}`));
    const seconds = bar.end ? ((Date.parse(bar.end) - Date.parse(bar.start)) / 1000).toFixed(1) : "unfinished";
    g.append(node("title", {}, `rollout ${bar.rollout} (group ${bar.group}, attempt ${bar.attempt}): `
      + `reward ${bar.reward ?? "–"}${bar.failure_kind ? ` (${bar.failure_kind} failure)` : ""}, ${seconds} s`
      + `${bar.straggler ? ", among the last to finish" : ""}`));
    g.addEventListener("click", () => { window.location.href = `/rollouts/${bar.rollout}/`; });
    barLayer.append(g);
  });
  svg.append(barLayer, labelLayer);

  const axis = node("g", { class: "axis" });
  axis.append(node("line", { x1: LEFT, x2: WIDTH - 10, y1: bottom + 2, y2: bottom + 2, stroke: "#667085" }));
  const total = (t1 - t0) / 1000;
  for (let k = 0; k <= 5; k += 1) {
    const seconds = (total * k) / 5;
    const tx = LEFT + (k / 5) * (WIDTH - LEFT - 10);
    axis.append(node("line", { x1: tx, x2: tx, y1: bottom + 2, y2: bottom + 6, stroke: "#667085" }));
    axis.append(node("text", { x: tx, y: bottom + 18, "text-anchor": k === 5 ? "end" : "middle", class: "tick" },
      `${seconds.toFixed(total < 1 ? 2 : total < 10 ? 1 : 0)} s`));
  }
  svg.append(axis);
  container.replaceChildren(svg);
  container.dataset.drawn = String(bars.length);
}
