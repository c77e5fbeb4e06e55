// One websocket per page, kept alive for as long as the page is open.
//  - Replay: a run page's socket asks for the events after the last seq it saw (`?after=`), so a reconnect loses
//    nothing; the runs list's feed has no seq of its own and backfills its rows in `onOpen` instead.
//  - Reconnects with exponential backoff (0.5 s doubling to 15 s, with jitter), at once when the browser comes back
//    online or the tab is shown again, and from a watchdog every 20 s should a close ever go unnoticed.
//  - The indicator (#live-indicator in base.html) says live, reconnecting or offline.
// `window.lightningLive` exposes the connection for tests: its state, reconnect count and socket.
const MIN_DELAY = 500;
const MAX_DELAY = 15000;

// `after`: with `replay`, the seq to replay from on the first connect (a page drawn from the current state needs only
// the recent events, not the run's whole history).
export function connectLive(path, { onEvent, onOpen = async () => {}, replay = false, after = 0 } = {}) {
  const indicator = document.getElementById("live-indicator");
  const live = { state: "connecting", reconnects: 0, lastSeq: after, socket: null, received: 0 };
  window.lightningLive = live;
  let delay = MIN_DELAY;
  let timer = null;

  const show = (state) => {
    live.state = state;
    if (!indicator) return;
    indicator.hidden = false;
    indicator.dataset.state = state;
    indicator.textContent = { live: "live", connecting: "connecting…", reconnecting: "reconnecting…",
                              offline: "offline" }[state];
    indicator.title = state === "live" ? "Updates arrive as they happen"
      : "Not connected: updates resume (and missed ones are filled in) when the connection is back";
  };

  const open = () => {
    clearTimeout(timer);
    timer = null;
    if (live.socket && live.socket.readyState <= WebSocket.OPEN) return;
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const query = replay ? `?after=${live.lastSeq}` : "";
    const socket = new WebSocket(`${scheme}://${location.host}${path}${query}`);
    live.socket = socket;
    socket.onopen = async () => {
      delay = MIN_DELAY;
      try {
        await onOpen(live);
      } catch (error) {
        console.warn("live backfill failed; retrying", error);
        socket.close();
        return;
      }
      if (live.socket === socket && socket.readyState === WebSocket.OPEN) show("live");
    };
    socket.onmessage = (message) => {
      const event = JSON.parse(message.data);
      if (replay && typeof event.seq === "number") {
        if (event.seq <= live.lastSeq) return;
        live.lastSeq = event.seq;
      }
      live.received += 1;
      onEvent(event);
    };
    socket.onclose = (close) => {
      if (live.socket !== socket) return;
      if (close.code === 4401 || close.code === 4404) {  // logged out, or the run is gone: retrying cannot help
        show("offline");
        return;
      }
      schedule();
    };
  };

  const schedule = () => {
    if (timer) return;
    show(navigator.onLine === false ? "offline" : "reconnecting");
    const wait = delay * (0.75 + Math.random() * 0.5);
    delay = Math.min(delay * 2, MAX_DELAY);
    live.reconnects += 1;
    timer = setTimeout(open, wait);
  };

  window.addEventListener("online", () => { delay = MIN_DELAY; open(); });
  window.addEventListener("offline", () => show("offline"));
  document.addEventListener("visibilitychange", () => {
    if (document.visibilityState === "visible" && live.socket?.readyState === WebSocket.CLOSED) open();
  });
  setInterval(() => {
    if (live.socket?.readyState === WebSocket.CLOSED && !timer) schedule();
  }, 20000);
  show("connecting");
  open();
  return live;
}
