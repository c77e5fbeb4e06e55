// Live events of one run over its websocket: replays after the last seq seen, reconnects without losing any.
export function followRun(runId, list) {
  let lastSeq = 0;
  let delay = 500;
  const connect = () => {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const socket = new WebSocket(`${scheme}://${location.host}/ws/runs/${runId}/?after=${lastSeq}`);
    socket.onopen = () => { delay = 500; };
    socket.onmessage = (message) => {
      const event = JSON.parse(message.data);
      if (event.seq <= lastSeq) return;
      lastSeq = event.seq;
      render(event);
      document.dispatchEvent(new CustomEvent("run-event", { detail: event }));  // e.g. for run_chart.js
    };
    socket.onclose = () => { setTimeout(connect, delay); delay = Math.min(delay * 2, 10000); };
  };
  const render = (event) => {
    const item = document.createElement("li");
    item.textContent = `#${event.seq} ${event.kind} ${JSON.stringify(event.payload)}`;  // text, never HTML
    if (event.kind !== "run.phase") list.appendChild(item);  // shown in place, above: one a second
    if (event.kind === "run.status") {
      const badge = document.getElementById("run-status");
      badge.textContent = event.payload.status;
      badge.className = `status status-${event.payload.status}`;
      if (event.payload.error) document.getElementById("run-error").textContent = event.payload.error;
    }
    if (event.kind === "run.phase") {
      const { phase, progress } = event.payload;
      const bar = document.getElementById("run-phase-progress");
      const known = typeof progress === "number";
      document.getElementById("run-phase").textContent = known ? `${phase} (${Math.round(progress * 100)}%)` : phase;
      bar.hidden = !known;
      if (known) bar.value = progress;
    }
  };
  connect();
}
