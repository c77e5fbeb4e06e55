// The reward editor's test panel: scores the source in the ace editor (saved or not) on a task and a typed outcome
// through POST /reward-scripts/test/, and shows the reward, the detail, the prints, or the error at its line.
// Everything from the server is shown as text (textContent), never parsed as HTML.

const panel = document.getElementById("reward-test");
const form = document.getElementById("reward-form");
const $ = (id) => document.getElementById(id);

function aceEditor() {
  const widget = form.querySelector(".django-ace-widget");
  return widget && widget.editor ? widget.editor : null;
}

function currentSource() {
  const editor = aceEditor();
  return editor ? editor.getValue() : form.querySelector("textarea[name=source]").value;
}

function show(element, visible) {
  element.hidden = !visible;
}

function taskSource() {
  return panel.querySelector("input[name=task_source]:checked").value;
}

function syncTaskSource() {
  const fromDataset = taskSource() === "dataset";
  show($("test-task-from-dataset"), fromDataset);
  show($("test-task-from-json"), !fromDataset);
}

// -------------------------------------------------------------- task search (the datalist of the task input)

let searchTimer = null;

async function searchTasks() {
  const dataset = $("test-dataset");
  if (!dataset) return;
  const url = new URL(panel.dataset.tasksUrl, window.location.href);
  url.searchParams.set("dataset", dataset.value);
  url.searchParams.set("q", $("test-task").value.trim());
  const response = await fetch(url, { headers: { Accept: "application/json" } });
  if (!response.ok) return;
  const body = await response.json();
  const list = $("test-task-options");
  list.replaceChildren(...body.tasks.map((task) => {
    const option = document.createElement("option");
    option.value = task.external_id;
    option.label = `#${task.index} · ${task.split}`;
    return option;
  }));
}

function scheduleSearch() {
  clearTimeout(searchTimer);
  searchTimer = setTimeout(() => { searchTasks().catch(() => {}); }, 200);
}

// -------------------------------------------------------------- scoring

function csrfToken() {
  return form.querySelector("input[name=csrfmiddlewaretoken]").value;
}

function clearErrors() {
  for (const id of ["test-task-error", "test-task-json-error", "test-request-error"]) {
    const element = $(id);
    if (element) { element.textContent = ""; show(element, false); }
  }
  const editor = aceEditor();
  if (editor) editor.getSession().clearAnnotations();
}

function showRequestErrors(errors) {
  const beside = { task: "test-task-error", dataset: "test-task-error", task_json: "test-task-json-error" };
  const general = [];
  for (const [name, messages] of Object.entries(errors)) {
    const element = beside[name] ? $(beside[name]) : null;
    if (element) {
      element.textContent = messages.join(" ");
      show(element, true);
    } else {
      general.push(name === "__all__" ? messages.join(" ") : `${name}: ${messages.join(" ")}`);
    }
  }
  if (general.length) {
    $("test-request-error").textContent = general.join("; ");
    show($("test-request-error"), true);
  }
}

function pretty(value) {
  return JSON.stringify(value, null, 2);
}

function showResult(result) {
  const status = $("test-status");
  // UnparseableOutcome: the script declared the outcome garbage; a run scores it as the policy's failure.
  status.textContent = result.ok ? "ok" : (result.kind === "unparseable" ? "unparseable: a run scores it as the policy's failure (failure_reward)" : (result.kind || "failed"));
  status.className = `status status-${result.ok ? "succeeded" : "failed"}`;
  $("test-reward").textContent = result.reward === null ? "none" : String(result.reward);
  $("test-duration").textContent = `${result.duration_ms} ms`;
  show($("test-error"), !result.ok);
  $("test-error-text").textContent = result.error;
  const line = $("test-error-line");
  line.textContent = result.line ? `line ${result.line}:` : "";
  line.dataset.line = result.line || "";
  show(line, Boolean(result.line));
  $("test-detail").textContent = pretty(result.detail);
  $("test-output").textContent = result.output || "(nothing printed)";
  $("test-task-label").textContent = result.task_label === "pasted" ? "the pasted task" : result.task_label;
  $("test-task-used").textContent = pretty(result.task);
  $("test-outcome-used").textContent = pretty(result.outcome);
  show($("test-result"), true);
  const editor = aceEditor();
  if (editor && result.line) {
    editor.getSession().setAnnotations([{ row: result.line - 1, column: 0, text: result.error, type: "error" }]);
    editor.gotoLine(result.line, 0, true);
  }
}

async function runTest() {
  clearErrors();
  const dataset = $("test-dataset");
  const body = {
    source: currentSource(),
    timeout_s: form.querySelector("input[name=timeout_s]").value || null,
    task_source: taskSource(),
    dataset: dataset ? dataset.value : null,
    task: $("test-task") ? $("test-task").value : "",
    task_json: $("test-task-json").value,
    outcome: $("test-outcome").value,
  };
  const button = $("test-run");
  button.disabled = true;
  show($("test-busy"), true);
  try {
    const response = await fetch(panel.dataset.testUrl, {
      method: "POST",
      headers: { "Content-Type": "application/json", Accept: "application/json", "X-CSRFToken": csrfToken() },
      body: JSON.stringify(body),
      credentials: "same-origin",
    });
    const answer = await response.json().catch(() => ({ errors: { __all__: [`the server answered ${response.status}`] } }));
    if (response.status === 202) {
      await awaitResult(answer.url);  // a worker scores it (the web server runs no user code)
    } else if (response.ok) {
      showResult(answer);
    } else {
      show($("test-result"), false);
      showRequestErrors(answer.errors || { __all__: [`the server answered ${response.status}`] });
    }
  } catch (error) {
    showRequestErrors({ __all__: [`could not reach the server: ${error.message}`] });
  } finally {
    button.disabled = false;
    show($("test-busy"), false);
    $("test-busy").textContent = "scoring…";
  }
}

const POLL_MS = 400;

async function awaitResult(url) {
  const busy = $("test-busy");
  for (;;) {
    const response = await fetch(url, { headers: { Accept: "application/json" }, credentials: "same-origin" });
    const answer = await response.json().catch(() => ({}));
    if (response.status === 200) {
      showResult(answer);
      return;
    }
    if (response.status !== 202) {
      show($("test-result"), false);
      showRequestErrors({ __all__: [answer.error || `the server answered ${response.status}`] });
      return;
    }
    busy.textContent = answer.status === "running" ? "scoring on a worker…"
      : `queued for a worker (${answer.waited_s} s; the control worker of ./lw up scores tests)`;
    await new Promise((resolve) => setTimeout(resolve, POLL_MS));
  }
}

// -------------------------------------------------------------- wiring

for (const radio of panel.querySelectorAll("input[name=task_source]")) {
  radio.addEventListener("change", syncTaskSource);
}
syncTaskSource();
if ($("test-dataset")) {
  $("test-dataset").addEventListener("change", () => { $("test-task").value = ""; scheduleSearch(); });
  $("test-task").addEventListener("input", scheduleSearch);
  scheduleSearch();
}
$("test-run").addEventListener("click", () => { runTest(); });

function whenEditorReady() {
  const editor = aceEditor();
  if (!editor) return;
  editor.getSession().on("change", () => editor.getSession().clearAnnotations());
  panel.dataset.ready = "1";
}

// django-ace builds its editor on window load; module scripts run before that, so wait for it.
if (document.readyState === "complete") {
  whenEditorReady();
} else {
  window.addEventListener("load", () => setTimeout(whenEditorReady, 0));
}
