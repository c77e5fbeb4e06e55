// The page of a harness check that has not ended: polls the check's API record every second, shows its status as
// text, and reloads once it has ended so the server renders the report (escaped by the template, never built here).

const badge = document.getElementById("check-status");
const waiting = document.getElementById("check-waiting");
const POLL_MS = 1000;

function show(status) {
  badge.textContent = status;
  badge.className = `status status-${status}`;
  badge.dataset.status = status;
  if (waiting) waiting.textContent = `The check is ${status}; this page updates when it ends.`;
}

async function poll() {
  try {
    const response = await fetch(badge.dataset.url, { credentials: "same-origin", headers: { Accept: "application/json" } });
    if (response.ok) {
      const check = await response.json();
      show(check.status);
      if (check.status === "succeeded" || check.status === "failed") {
        window.location.reload();
        return;
      }
    }
  } catch (error) {
    // The server restarting or the network away for a moment: the next poll tries again.
  }
  window.setTimeout(poll, POLL_MS);
}

if (badge && badge.dataset.finished !== "1") window.setTimeout(poll, POLL_MS);
