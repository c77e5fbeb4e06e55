// The run page: one websocket (live.js) feeds the header, the charts, the rollouts table and the event log. The page
// is drawn from the run's current state (header on the server, charts and table over HTTP), so the socket replays
// only the last LOG_LINES events (for the event log) and what follows, not the run's whole history: a run with 10k
// rollouts has tens of thousands of events. `window.runPage` exposes the parts for tests.
import { connectLive } from "./live.js";
import { RunCharts } from "./run_chart.js";
import { EventLog, RunHeader } from "./run_events.js";
import { RolloutsTable } from "./rollouts_table.js";
import { startValGrid } from "./val_grid.js";

const LOG_LINES = 500;

export function startRunPage(config) {
  const header = new RunHeader(config);
  const log = new EventLog(document.getElementById("events"));
  const charts = new RunCharts(config);
  const table = new RolloutsTable(document.getElementById("rollouts"));
  const [valGrid, steps] = startValGrid(config);  // loads the validation grid and the steps list
  const health = new HealthPanel(config);
  const parts = [header, log, charts, table, valGrid, steps, health].filter(Boolean);
  window.runPage = { header, log, charts, table, valGrid, steps, health };
  connectLive(`/ws/runs/${config.run}/`, {
    replay: true,
    after: Math.max(0, config.last_seq - LOG_LINES),
    onEvent: (event) => {
      for (const part of parts) {
        try {
          part.apply(event);
        } catch (error) {
          console.error(`run page: event ${event.seq} (${event.kind}) not shown`, error);
        }
      }
    },
  });
  charts.load();
  table.refresh();
}

// The health panel (templates/runs/_run_health.html): drawn by the server, reloaded whole on each run.alarm event
// after the page was drawn (an alarm raised or acknowledged); the re-scoring box stays open if it was.
class HealthPanel {
  constructor(config) {
    this.config = config;
    this.loading = null;
    this.reloads = 0;
  }

  apply(event) {
    if (event.kind === "run.alarm" && event.seq > this.config.last_seq) this.reload();
  }

  async reload() {
    if (this.loading) {  // an event during a load: load again after it, so the panel ends current
      this.again = true;
      return this.loading;
    }
    const section = document.getElementById("health");
    if (!section) return null;
    this.loading = (async () => {
      try {
        const response = await fetch(section.dataset.url, { headers: { Accept: "text/html" } });
        if (!response.ok) throw new Error(`health panel: HTTP ${response.status}`);
        const open = document.getElementById("rescore-box")?.open;
        const holder = document.createElement("div");
        holder.innerHTML = await response.text();
        const fresh = holder.querySelector("#health");
        if (fresh) {
          document.getElementById("health").replaceWith(fresh);
          if (open) document.getElementById("rescore-box").open = true;
          this.reloads += 1;
        }
      } finally {
        this.loading = null;
        if (this.again) {
          this.again = false;
          this.reload();
        }
      }
    })();
    return this.loading;
  }
}
