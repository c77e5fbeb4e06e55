// The token view of a training sample (runs.pages.token_view): the page's first chunk is rendered at once, the
// rest is fetched from the JSON endpoint chunk by chunk and rendered a frame at a time, so a 32k-token sample opens
// fast. Token text always goes in through textContent. Shading is a bucket per token (data-b, data-t, data-m) that
// CSS colours by the mode class on #token-view, so switching modes touches one attribute.
const FRAME_TOKENS = 1500;  // tokens appended per animation frame
const BUCKETS = 10;

function probabilityBucket(logprob) {  // 0: probability ~1 (no shade) .. 9: very unlikely
  return Math.min(BUCKETS - 1, Math.floor((1 - Math.exp(logprob)) * BUCKETS));
}

function mismatchBucket(gap) {  // log scale: 0.01 -> 1, 0.1 -> 5, 1 -> 9
  return Math.min(BUCKETS - 1, Math.floor(Math.log10(1 + gap * 100) / 2 * BUCKETS));
}

function nextFrame() {  // a frame, or a timer where frames do not come (a background tab)
  return new Promise((resolve) => { requestAnimationFrame(() => resolve()); setTimeout(resolve, 100); });
}

function visible(text, showWhitespace) {
  if (!showWhitespace) return text;
  return text.replace(/ /g, "·").replace(/\t/g, "→\t").replace(/\r/g, "␍").replace(/\n/g, "↵\n");
}

function fixed(value, digits) {
  return value === null || value === undefined ? "–" : Number(value).toFixed(digits);
}

class TokenView {
  constructor(config) {
    this.config = config;
    this.root = document.getElementById("token-view");
    this.info = document.getElementById("token-info");
    this.progress = document.getElementById("token-progress");
    this.tokens = new Array(config.total);
    this.spans = config.spans;  // [call_seq, start, end, sampled], in token order
    this.spanAt = new Map(config.spans.map((span) => [span[1], span]));
    this.showWhitespace = true;
    this.rendered = 0;
    this.pinned = null;
    this.done = null;
    this.bind();
  }

  start() {
    this.append(this.config.first);
    this.done = this.loadRest();
    this.done.catch((error) => { this.progress.textContent = `Could not load the rest of the tokens: ${error}`; });
  }

  renderAll() {
    return this.done.then(() => this.rendered);
  }

  async fetchChunk(start) {
    const { chunk, data_url: url } = this.config;
    const response = await fetch(`${url}?start=${start}&count=${chunk}`, { credentials: "same-origin" });
    if (!response.ok) throw new Error(`${response.status} ${response.statusText}`);
    return response.json();
  }

  async loadRest() {
    const total = this.config.total;
    let next = this.rendered < total ? this.fetchChunk(this.rendered) : null;
    while (next !== null) {
      this.progress.textContent = `rendering ${this.rendered} / ${total} tokens…`;
      const data = await next;
      if (!data.tokens.length) break;
      const after = data.start + data.tokens.length;
      next = after < total ? this.fetchChunk(after) : null;  // the next chunk loads while this one renders
      for (let at = 0; at < data.tokens.length; at += FRAME_TOKENS) {
        await nextFrame();
        this.append(data.tokens.slice(at, at + FRAME_TOKENS));
      }
    }
    this.progress.textContent = "";
  }

  append(tokens) {
    const fragment = document.createDocumentFragment();
    for (const token of tokens) {
      this.tokens[token.i] = token;
      const span = this.spanAt.get(token.i);
      if (span) fragment.appendChild(this.boundary(span));
      fragment.appendChild(this.tokenElement(token));
    }
    this.root.appendChild(fragment);
    this.rendered += tokens.length;
    this.root.dataset.rendered = String(this.rendered);
  }

  boundary([seq, start, end, sampled]) {
    const marker = document.createElement("span");
    marker.className = `span-boundary ${sampled ? "span-sampled" : "span-prompt"}`;
    marker.dataset.callSeq = String(seq);
    marker.dataset.start = String(start);
    const drift = this.config.drift[String(seq)];
    marker.textContent = `call ${seq} · ${sampled ? "sampled" : "prompt"}${drift && !sampled ? ` · ${drift}` : ""}`;
    marker.title = `tokens ${start}–${end - 1} ${sampled ? "sampled by" : "given as prompt to"} call ${seq}`;
    return marker;
  }

  tokenElement(token) {
    const el = document.createElement("span");
    el.className = token.mask ? "tok trained" : "tok context";
    el.dataset.i = String(token.i);
    if (token.lp !== null) { el.dataset.lp = String(token.lp); el.dataset.b = String(probabilityBucket(token.lp)); }
    if (token.tlp !== null) { el.dataset.tlp = String(token.tlp); el.dataset.t = String(probabilityBucket(token.tlp)); }
    if (token.mismatch !== null) el.dataset.m = String(mismatchBucket(token.mismatch));
    this.setText(el, token);
    return el;
  }

  setText(el, token) {
    if (token.text === null) {
      el.classList.add("id-only");
      el.textContent = `#${token.id}`;
    } else if (token.text === "") {
      el.classList.add("partial");  // part of a character that the next token completes
      el.textContent = "◌";
    } else {
      el.textContent = visible(token.text, this.showWhitespace);
    }
  }

  bind() {
    document.getElementById("shade-mode").addEventListener("change", (event) => {
      this.root.classList.remove("shade-behaviour", "shade-trainer", "shade-mismatch", "shade-none");
      this.root.classList.add(`shade-${event.target.value}`);
    });
    document.getElementById("show-whitespace").addEventListener("change", (event) => {
      this.showWhitespace = event.target.checked;
      this.root.classList.toggle("show-ws", this.showWhitespace);
      for (const el of this.root.querySelectorAll(".tok")) this.setText(el, this.tokens[Number(el.dataset.i)]);
    });
    this.root.addEventListener("mouseover", (event) => {
      const el = event.target.closest(".tok");
      if (el && this.pinned === null) this.show(el);
    });
    this.root.addEventListener("click", (event) => {
      const el = event.target.closest(".tok");
      if (!el) return;
      const previous = this.root.querySelector(".tok.pinned");
      if (previous) previous.classList.remove("pinned");
      if (this.pinned === el) { this.pinned = null; return; }
      this.pinned = el;
      el.classList.add("pinned");
      this.show(el);
    });
  }

  callOf(index) {  // the span holding token `index` (spans are sorted by start)
    let lo = 0, hi = this.spans.length - 1;
    while (lo <= hi) {
      const mid = (lo + hi) >> 1, [, start, end] = this.spans[mid];
      if (index < start) hi = mid - 1; else if (index >= end) lo = mid + 1; else return this.spans[mid];
    }
    return null;
  }

  show(el) {
    const token = this.tokens[Number(el.dataset.i)];
    const span = this.callOf(token.i);
    const rows = [
      ["Index", String(token.i)], ["Id", String(token.id)],
      ["Text", token.text === null ? "(no tokenizer)" : JSON.stringify(token.text)],
      ["Loss mask", token.mask ? "1 (trained)" : "0 (context)"],
      ["Behaviour logprob", fixed(token.lp, 5)],
      ["Probability", token.lp === null ? "–" : fixed(Math.exp(token.lp), 4)],
      ["Trainer logprob", fixed(token.tlp, 5)], ["Mismatch", fixed(token.mismatch, 6)],
      ["Call", span ? `${span[0]} (${span[3] ? "sampled" : "prompt"})` : "–"],
    ];
    const list = document.createElement("dl");
    list.id = "token-info-facts";
    for (const [name, value] of rows) {
      const dt = document.createElement("dt");
      dt.textContent = name;
      const dd = document.createElement("dd");
      dd.textContent = value;
      list.append(dt, dd);
    }
    this.info.replaceChildren(list);
  }
}

export function startTokenView(config) {
  const view = new TokenView(config);
  window.tokenView = { renderAll: () => view.renderAll(), view };
  view.start();
  return view;
}
