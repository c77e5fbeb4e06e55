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
  const parts = [header, log, charts, table, valGrid, steps].filter(Boolean);
  window.runPage = { header, log, charts, table, valGrid, steps };
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
