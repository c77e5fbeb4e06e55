// The run page: one websocket (live.js, replaying from the run's first event) feeds the header, the charts, the
// rollouts table and the event log. `window.runPage` exposes the parts for tests.
import { connectLive } from "./live.js";
import { RunCharts } from "./run_chart.js";
import { EventLog, RunHeader } from "./run_events.js";
import { RolloutsTable } from "./rollouts_table.js";

export function startRunPage(config) {
  const header = new RunHeader(config);
  const log = new EventLog(document.getElementById("events"));
  const charts = new RunCharts(config);
  const table = new RolloutsTable(document.getElementById("rollouts"));
  const parts = [header, log, charts, table];
  window.runPage = { header, log, charts, table };
  connectLive(`/ws/runs/${config.run}/`, {
    replay: true,
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
