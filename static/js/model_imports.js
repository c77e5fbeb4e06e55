// The models page follows its running imports: polls the status endpoint, shows each state and message as
// text, and reloads once an import is done so the registry table lists the new model.
const list = document.getElementById("imports");
const EVERY_MS = 2000;

function active(state) {
  return state === "queued" || state === "running";
}

function show(item) {
  const row = [...list.querySelectorAll("li[data-import]")].find((li) => li.dataset.import === item.name);
  if (!row) return false;
  const before = row.dataset.state;
  row.dataset.state = item.state;
  const badge = row.querySelector(".import-state");
  badge.dataset.state = item.state;
  badge.textContent = item.state;
  row.querySelector(".import-message").textContent = item.message || "";
  const error = row.querySelector(".import-error");
  error.textContent = item.error || "";
  error.hidden = !item.error;
  return active(before) && item.state === "done";
}

async function poll() {
  let finished = false;
  let stillActive = false;
  try {
    const response = await fetch(list.dataset.statusUrl, { headers: { Accept: "application/json" } });
    if (!response.ok) throw new Error(`status ${response.status}`);
    const body = await response.json();
    for (const item of body.imports) {
      finished = show(item) || finished;
      stillActive = stillActive || active(item.state);
    }
  } catch (err) {
    stillActive = true; // a failed poll is retried: the server may be restarting
  }
  if (finished) {
    window.location.reload();
  } else if (stillActive) {
    setTimeout(poll, EVERY_MS);
  }
}

if (list && [...list.querySelectorAll("li[data-import]")].some((li) => active(li.dataset.state))) {
  setTimeout(poll, EVERY_MS);
}
