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
    };
    socket.onclose = () => { setTimeout(connect, delay); delay = Math.min(delay * 2, 10000); };
  };
  const render = (event) => {
    const item = document.createElement("li");
    item.textContent = `#${event.seq} ${event.kind} ${JSON.stringify(event.payload)}`;  // text, never HTML
    list.appendChild(item);
    if (event.kind === "run.status") {
      const badge = document.getElementById("run-status");
      badge.textContent = event.payload.status;
      badge.className = `status status-${event.payload.status}`;
      if (event.payload.error) document.getElementById("run-error").textContent = event.payload.error;
    }
  };
  connect();
}
