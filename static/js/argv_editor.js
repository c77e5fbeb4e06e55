// List editors of the harness form: argv rows (add, remove, move up/down) and env key/value rows.
// The rows are plain repeated inputs (name="argv", name="env_key"/"env_value"): the server reads them in order,
// with or without this script. Placeholder buttons put their token where the caret was in the last field edited.

const editors = document.querySelectorAll("[data-list-editor]");
let lastField = null;
let lastCaret = null;

function rowsOf(list) {
  return Array.from(list.querySelectorAll(":scope > .list-row"));
}

function refresh(list) {
  const rows = rowsOf(list);
  rows.forEach((row, i) => {
    const up = row.querySelector("[data-action=up]");
    const down = row.querySelector("[data-action=down]");
    if (up) up.disabled = i === 0;
    if (down) down.disabled = i === rows.length - 1;
  });
}

function blankRow(list) {
  const rows = rowsOf(list);
  const row = rows[rows.length - 1].cloneNode(true);
  row.querySelectorAll("input").forEach((input) => { input.value = ""; });
  list.appendChild(row);
  refresh(list);
  return row;
}

function onClick(list, event) {
  const button = event.target.closest("button[data-action]");
  if (!button) return;
  const row = button.closest(".list-row");
  const action = button.dataset.action;
  if (action === "remove") {
    if (rowsOf(list).length === 1) {
      row.querySelectorAll("input").forEach((input) => { input.value = ""; });  // keep one row to type in
    } else {
      row.remove();
    }
  } else if (action === "up" && row.previousElementSibling) {
    list.insertBefore(row, row.previousElementSibling);
  } else if (action === "down" && row.nextElementSibling) {
    list.insertBefore(row.nextElementSibling, row);
  }
  refresh(list);
  const input = row.isConnected ? row.querySelector("input") : null;
  if (input && action !== "remove") input.focus();
}

function insertPlaceholder(token) {
  let field = lastField;
  if (!field || !field.isConnected) {
    const list = document.querySelector("[data-list-editor=argv]");
    const rows = rowsOf(list);
    const last = rows[rows.length - 1].querySelector("input");
    field = last.value === "" ? last : blankRow(list).querySelector("input");
    lastCaret = null;
  }
  const at = document.activeElement === field ? field.selectionStart
    : (lastCaret === null ? field.value.length : lastCaret);
  field.value = field.value.slice(0, at) + token + field.value.slice(at);
  field.focus();
  field.setSelectionRange(at + token.length, at + token.length);
  lastField = field;
  lastCaret = at + token.length;
}

for (const list of editors) {
  list.addEventListener("click", (event) => onClick(list, event));
  list.addEventListener("focusin", (event) => {
    if (event.target.matches("input[name=argv], input[name=env_value]")) lastField = event.target;
  });
  list.addEventListener("focusout", (event) => {
    if (event.target === lastField) lastCaret = lastField.selectionStart;
  });
  refresh(list);
  list.closest("form").classList.add("list-editors-ready");
}

for (const add of document.querySelectorAll("button[data-add]")) {
  add.addEventListener("click", () => {
    const list = document.querySelector(`[data-list-editor=${add.dataset.add}]`);
    blankRow(list).querySelector("input").focus();
  });
}

for (const button of document.querySelectorAll("button[data-placeholder]")) {
  button.addEventListener("mousedown", (event) => event.preventDefault());  // keep the caret in the field
  button.addEventListener("click", () => insertPlaceholder(button.dataset.placeholder));
}
