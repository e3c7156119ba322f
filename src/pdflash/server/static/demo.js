// pdflash demo page: several prompts streaming side by side over one websocket (/ws).
// Protocol: docs/websocket.md. Plain JS, no build step, no external resources.
"use strict";

const DEFAULT_PROMPTS = [
  "def fibonacci(n):",
  "The three laws of thermodynamics are",
  "Write a haiku about the sea.",
];
const MAX_BARS = 64;

const $ = (id) => document.getElementById(id);
const panes = new Map(); // pane number -> pane
const running = new Map(); // generation id -> pane
let socket = null;
let nextPane = 1;
let nextGeneration = 1;
let retryDelayMs = 500;

// -- formatting --------------------------------------------------------------------------

function formatBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i += 1; }
  return `${n.toFixed(i === 0 ? 0 : 1)} ${units[i]}`;
}

const formatRate = (x) => (x === null || x === undefined ? "–" : x.toFixed(1));
const formatPercent = (x) => (x === null || x === undefined ? "–" : `${(100 * x).toFixed(1)}%`);

// -- the websocket -----------------------------------------------------------------------

// With `pdflash serve --api-key`, the page asks for the key once (kept in this browser's
// localStorage) and sends it as the socket's first message; the page itself needs no key.
function apiKey() {
  const params = new URLSearchParams(location.search);
  if (params.get("api_key")) localStorage.setItem("pdflash-api-key", params.get("api_key"));
  return localStorage.getItem("pdflash-api-key");
}

// The max-tokens field is bounded by the served model's context (/v1/models' max_model_len).
function boundMaxTokens() {
  const key = apiKey();
  fetch("/v1/models", { headers: key ? { Authorization: `Bearer ${key}` } : {} })
    .then((r) => (r.ok ? r.json() : null))
    .then((body) => {
      const limit = body && body.data && body.data[0] && body.data[0].max_model_len;
      if (!limit) return;
      const field = $("max-tokens");
      field.max = String(limit - 1);
      if (parseInt(field.value, 10) > limit - 1) field.value = String(limit - 1);
    })
    .catch(() => {});
}

function connect() {
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  socket = new WebSocket(`${scheme}://${location.host}/ws`);
  setConnection("connecting…", "");
  socket.addEventListener("open", () => {
    const key = apiKey();
    if (key) socket.send(JSON.stringify({ type: "auth", api_key: key }));
    retryDelayMs = 500;
    setConnection("connected", "up");
    updateButtons();
  });
  socket.addEventListener("message", (event) => {
    const message = JSON.parse(event.data);
    if (message.type === "error" && message.code === "invalid_api_key") {
      const key = prompt("This server needs an API key:");
      if (key) localStorage.setItem("pdflash-api-key", key);
      return;
    }
    handle(message);
  });
  socket.addEventListener("close", () => {
    setConnection("disconnected — reconnecting", "down");
    for (const pane of running.values()) finish(pane, "connection lost", true);
    running.clear();
    updateButtons();
    setTimeout(connect, retryDelayMs);
    retryDelayMs = Math.min(retryDelayMs * 2, 5000);
  });
}

function send(message) {
  if (socket && socket.readyState === WebSocket.OPEN) {
    socket.send(JSON.stringify(message));
    return true;
  }
  notice("not connected to the server yet");
  return false;
}

function setConnection(text, state) {
  $("connection").textContent = text;
  $("connection-dot").className = `dot ${state}`;
}

function notice(text) {
  $("notice").textContent = text;
}

function handle(msg) {
  if (msg.type === "stats") return showStats(msg);
  const pane = running.get(msg.id);
  if (msg.type === "delta" && pane) return showDelta(pane, msg);
  if (msg.type === "done" && pane) {
    running.delete(msg.id);
    const m = msg.metrics || {};
    finish(pane, `finished: ${msg.finish_reason}, ${m.generated_tokens ?? pane.tokens} tokens` +
      (m.ttft_s ? `, first token after ${(1000 * m.ttft_s).toFixed(0)} ms` : ""), false);
    return;
  }
  if (msg.type === "error") {
    if (pane && msg.code !== "duplicate_id") {
      running.delete(msg.id);
      finish(pane, `error: ${msg.message}`, true);
    } else {
      notice(`server: ${msg.message}`);
    }
  }
}

// -- engine-wide stats -------------------------------------------------------------------

function showStats(s) {
  $("model").textContent = s.model ? `model: ${s.model}` : "";
  $("stat-live").textContent = s.live_sequences;
  $("stat-waiting").textContent = s.waiting;
  $("stat-tps").textContent = formatRate(s.tokens_per_second);
  $("stat-tau").textContent = s.mean_acceptance_length ? s.mean_acceptance_length.toFixed(2) : "–";
  $("stat-vetoed").textContent = s.drafts_vetoed ?? "–";
  $("stat-fetched").textContent = s.link ? formatBytes(s.expert_bytes_fetched) : "not offloading";
  $("stat-hit").textContent = formatPercent(s.expert_cache_hit_rate);
  $("stat-projected").textContent = formatBytes(s.expert_bytes_projected);
  $("stat-link").textContent = s.link ?? "all experts resident";
}

// -- panes -------------------------------------------------------------------------------

function addPane(prompt) {
  const n = nextPane++;
  const node = $("pane-template").content.firstElementChild.cloneNode(true);
  const pane = {
    n, node, id: null, tokens: 0, firstAt: null, lastAt: null, rounds: [], blocks: [], bytes: 0,
    form: node.querySelector("form"),
    prompt: node.querySelector(".prompt"),
    output: node.querySelector(".output"),
    start: node.querySelector(".start"),
    stop: node.querySelector(".stop"),
    remove: node.querySelector(".remove"),
    status: node.querySelector(".status"),
    bars: node.querySelector(".acceptance"),
    barsText: node.querySelector(".acceptance-text"),
  };
  const label = node.querySelector(".pane-label");
  label.textContent = `Prompt ${n}`;
  label.htmlFor = pane.prompt.id = `prompt-${n}`;
  pane.output.id = `output-${n}`;
  pane.output.setAttribute("aria-label", `Generated text ${n}`);
  pane.remove.setAttribute("aria-label", `Remove prompt ${n}`);
  pane.prompt.value = prompt;
  pane.form.addEventListener("submit", (e) => { e.preventDefault(); start(pane); });
  pane.prompt.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); start(pane); }
  });
  pane.stop.addEventListener("click", () => stop(pane));
  pane.remove.addEventListener("click", () => removePane(pane));
  panes.set(n, pane);
  $("panes").appendChild(node);
  updateButtons();
  return pane;
}

function removePane(pane) {
  stop(pane);
  panes.delete(pane.n);
  pane.node.remove();
  const next = [...panes.values()].at(-1);
  (next ? next.prompt : $("add-pane")).focus();
}

function params() {
  const maxTokens = parseInt($("max-tokens").value, 10);
  const temperature = parseFloat($("temperature").value);
  return {
    max_tokens: Number.isFinite(maxTokens) ? maxTokens : 96,
    temperature: Number.isFinite(temperature) ? temperature : 0,
  };
}

function start(pane) {
  if (pane.id !== null) return; // already running
  const id = `p${pane.n}-${nextGeneration++}`;
  if (!send({ type: "start", id, prompt: pane.prompt.value, params: params() })) return;
  notice("");
  Object.assign(pane, { id, tokens: 0, firstAt: null, lastAt: null, rounds: [], blocks: [], bytes: 0, startedAt: performance.now() });
  running.set(id, pane);
  pane.output.textContent = "";
  pane.bars.replaceChildren();
  pane.barsText.textContent = "";
  pane.status.classList.remove("error");
  pane.status.textContent = "running…";
  pane.node.dataset.state = "running";
  showPaneStats(pane);
  updateButtons();
}

function stop(pane) {
  if (pane.id !== null) send({ type: "cancel", id: pane.id });
}

function showDelta(pane, msg) {
  const now = performance.now();
  if (msg.token_ids.length) {
    if (pane.firstAt === null) pane.firstAt = now;
    pane.lastAt = now;
    pane.tokens += msg.token_ids.length;
  }
  const atBottom = pane.output.scrollHeight - pane.output.scrollTop - pane.output.clientHeight < 8;
  pane.output.textContent += msg.text;
  if (atBottom) pane.output.scrollTop = pane.output.scrollHeight;
  pane.bytes += msg.expert_bytes || 0;
  const blocks = msg.block_sizes || [];
  (msg.acceptance_lengths || []).forEach((length, i) => addBar(pane, length, blocks[i]));
  showPaneStats(pane);
}

function addBar(pane, length, block) {
  pane.rounds.push(length);
  pane.blocks.push(block ?? "?");
  const bar = document.createElement("span");
  bar.dataset.length = length;
  bar.title = `round ${pane.rounds.length}: verified ${block ?? "?"}, emitted ${length}`;
  pane.bars.appendChild(bar);
  while (pane.bars.childElementCount > MAX_BARS) pane.bars.firstElementChild.remove();
  const tallest = Math.max(4, ...pane.rounds.slice(-MAX_BARS));
  for (const b of pane.bars.children) b.style.height = `${(100 * Number(b.dataset.length)) / tallest}%`;
  const recent = pane.rounds.slice(-24).map((n, i) => `${n}/${pane.blocks.slice(-24)[i]}`);
  pane.barsText.textContent = `emitted/verified per round (the block the policy chose): ${recent.join(" ")}`;
}

function showPaneStats(pane) {
  const q = (sel) => pane.node.querySelector(sel);
  q(".s-tokens").textContent = pane.tokens;
  const span = (pane.lastAt - pane.firstAt) / 1000;
  q(".s-tps").textContent = pane.tokens > 1 && span > 0 ? ((pane.tokens - 1) / span).toFixed(1) : "–";
  const rounds = pane.rounds.length;
  q(".s-tau").textContent = rounds ? (pane.rounds.reduce((a, b) => a + b, 0) / rounds).toFixed(2) : "–";
  q(".s-bytes").textContent = pane.bytes ? formatBytes(pane.bytes) : "–";
}

function finish(pane, text, isError) {
  pane.id = null;
  pane.node.dataset.state = isError ? "error" : "done";
  pane.status.textContent = text;
  pane.status.classList.toggle("error", isError);
  updateButtons();
}

function updateButtons() {
  const open = socket && socket.readyState === WebSocket.OPEN;
  for (const pane of panes.values()) {
    pane.start.disabled = !open || pane.id !== null;
    pane.stop.disabled = pane.id === null;
  }
  $("start-all").disabled = !open;
}

// -- page setup --------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  for (const prompt of DEFAULT_PROMPTS) addPane(prompt);
  $("add-pane").addEventListener("click", () => addPane("").prompt.focus());
  $("start-all").addEventListener("click", () => { for (const pane of panes.values()) start(pane); });
  $("stop-all").addEventListener("click", () => { for (const pane of panes.values()) stop(pane); });
  boundMaxTokens();
  connect();
});
