// The rollout page (templates/runs/rollout.html) and the val task comparison (templates/runs/val_task_compare.html):
// each call's raw JSON fetched on first toggle (runs.pages.rollout_page.rollout_call_raw) and shown as text, j/k to
// the next/previous rollout of the group, and the comparison's selects reloading the page.

function isTyping(target) {
  return target instanceof HTMLElement && (target.isContentEditable || /^(INPUT|TEXTAREA|SELECT)$/.test(target.tagName));
}

export function bindGroupKeys(doc = document) {
  doc.addEventListener("keydown", (event) => {
    if (event.ctrlKey || event.metaKey || event.altKey || isTyping(event.target)) return;
    const link = { j: "next-in-group", k: "prev-in-group" }[event.key];
    const target = link && doc.getElementById(link);
    if (target) {
      event.preventDefault();
      window.location.assign(target.href);
    }
  });
}

async function loadRaw(section, button) {
  const response = await fetch(button.dataset.url, { headers: { Accept: "application/json" } });
  if (!response.ok) throw new Error(`HTTP ${response.status}`);
  const body = await response.json();
  section.querySelector("pre.raw-request").textContent = JSON.stringify(body.request, null, 2);
  section.querySelector("pre.raw-response").textContent = JSON.stringify(body.response, null, 2);
}

export function bindRawToggles(root = document) {
  root.addEventListener("click", async (event) => {
    const button = event.target.closest("button.raw-toggle");
    if (!button) return;
    const section = button.closest("section.call");
    const parts = [section.querySelector(".raw"), ...section.querySelectorAll("pre.raw-request, pre.raw-response")];
    const opening = button.getAttribute("aria-expanded") !== "true";
    if (opening && !button.dataset.loaded) {
      button.disabled = true;
      try {
        await loadRaw(section, button);
        button.dataset.loaded = "1";
      } catch (error) {
        section.querySelector("pre.raw-request").textContent = `could not load the raw JSON: ${error.message}`;
      } finally {
        button.disabled = false;
      }
    }
    for (const part of parts) part.hidden = !opening;
    button.setAttribute("aria-expanded", String(opening));
  });
}

export function bindCompareSelects(doc = document) {
  const form = doc.getElementById("compare-form");
  if (!form) return;
  form.addEventListener("change", () => form.submit());
}

bindGroupKeys();
bindRawToggles();
bindCompareSelects();
