// A small inline SVG line of [step, value] points (the runs list's reward trend). Built with createElementNS from
// numbers only: nothing from the page's data is parsed as markup.
const SVG = "http://www.w3.org/2000/svg";

export function sparkline(points, { width = 120, height = 28, label = "" } = {}) {
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("class", "sparkline");
  svg.setAttribute("width", String(width));
  svg.setAttribute("height", String(height));
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("role", "img");
  const clean = points.map(([x, y]) => [Number(x), Number(y)]).filter(([x, y]) => isFinite(x) && isFinite(y));
  svg.dataset.points = String(clean.length);
  const title = document.createElementNS(SVG, "title");
  if (!clean.length) {
    title.textContent = `${label}: no points yet`;
    svg.appendChild(title);
    return svg;
  }
  const [lastStep, lastValue] = clean[clean.length - 1];
  title.textContent = `${label}: ${lastValue.toFixed(3)} at step ${lastStep} (${clean.length} points)`;
  svg.appendChild(title);
  const xs = clean.map(([x]) => x);
  const ys = clean.map(([, y]) => y);
  const [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  const [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  const pad = 2;
  const sx = (x) => (x1 === x0 ? width / 2 : pad + ((x - x0) / (x1 - x0)) * (width - 2 * pad));
  const sy = (y) => (y1 === y0 ? height / 2 : height - pad - ((y - y0) / (y1 - y0)) * (height - 2 * pad));
  const line = document.createElementNS(SVG, "polyline");
  line.setAttribute("points", clean.map(([x, y]) => `${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join(" "));
  line.setAttribute("fill", "none");
  line.setAttribute("stroke", "currentColor");
  line.setAttribute("stroke-width", "1.5");
  svg.appendChild(line);
  const dot = document.createElementNS(SVG, "circle");
  dot.setAttribute("cx", sx(lastStep).toFixed(1));
  dot.setAttribute("cy", sy(lastValue).toFixed(1));
  dot.setAttribute("r", "2");
  dot.setAttribute("fill", "currentColor");
  svg.appendChild(dot);
  return svg;
}
