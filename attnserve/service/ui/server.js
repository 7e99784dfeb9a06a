// The Server view: the served models (/v1/server) and live figures read from /metrics
// (Prometheus' text format), refreshed every few seconds while the view is shown.

import { call, formatNumber } from "./api.js";

const $ = (id) => document.getElementById(id);
export const REFRESH_MS = 3000;

let info = null;
let previous = null; // {at, samples} of the last scrape
let timer = 0;
let loops = 0;

// Prometheus text exposition -> [{name, labels, value}] (comments and blank lines skipped).
export function parseMetrics(text) {
  const samples = [];
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const match = line.match(/^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/);
    if (!match) continue;
    const labels = {};
    for (const [, key, raw] of (match[2] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) {
      labels[key] = raw.replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
    }
    const raw = match[3];
    const value = raw === "+Inf" ? Infinity : raw === "-Inf" ? -Infinity : Number(raw);
    samples.push({ name: match[1], labels, value });
  }
  return samples;
}

// The sum of a metric's samples, for one model or all of them.
function total(samples, name, model = null) {
  let sum = 0;
  for (const s of samples) {
    if (s.name === name && (model === null || s.labels.model === model)) sum += s.value;
  }
  return sum;
}

// Per second between two scrapes (null on the first).
function rate(now, name, model) {
  if (!previous) return null;
  const seconds = (now.at - previous.at) / 1000;
  const delta = total(now.samples, name, model) - total(previous.samples, name, model);
  return seconds > 0 ? Math.max(delta, 0) / seconds : null;
}

// Mean time to first token (ms) of the requests since the last scrape, else since start.
function timeToFirstToken(now, model) {
  const sum = "attnserve_time_to_first_token_seconds_sum";
  const count = "attnserve_time_to_first_token_seconds_count";
  const n = total(now.samples, count, model);
  if (previous) {
    const dn = n - total(previous.samples, count, model);
    if (dn > 0) {
      const ds = total(now.samples, sum, model) - total(previous.samples, sum, model);
      return { ms: (1000 * ds) / dn, recent: true };
    }
  }
  return n > 0 ? { ms: (1000 * total(now.samples, sum, model)) / n, recent: false } : null;
}

function cell(text) {
  const td = document.createElement("td");
  td.textContent = text;
  return td;
}

function languages(m) {
  if (m.kind !== "translation") return "–";
  const from = m.source_languages ? m.source_languages.join(", ") : "any";
  return `${from} → ${m.target_languages.join(", ")}`;
}

export function init(serverInfo) {
  info = serverInfo;
  const rows = info.models.map((m) => {
    const row = document.createElement("tr");
    row.dataset.model = m.name;
    const name = document.createElement("th");
    name.scope = "row";
    name.textContent = m.name;
    if (m.default) {
      const badge = document.createElement("span");
      badge.className = "badge";
      badge.textContent = "default";
      name.append(" ", badge);
    }
    row.append(
      name,
      cell(m.kind === "generation" ? "language model" : "translation"),
      cell(m.variant ? `${m.backend} ${m.variant}` : m.backend),
      cell(m.threads === null ? "auto" : String(m.threads)),
      cell(formatNumber(m.context_length)),
      cell(languages(m)),
      cell("–"),
      cell("–"),
      cell("–"),
    );
    return row;
  });
  $("models-body").replaceChildren(...rows);
  const limits = info.limits;
  const entries = [
    ["Version", info.version],
    ["Batching", `${info.batching}, up to ${formatNumber(info.max_batch_rows)} rows`],
    ["Request body", `${formatNumber(limits.max_body_bytes)} bytes`],
    ["Texts / sentences per request", `${limits.max_texts_per_request} / ${limits.max_sentences_per_request}`],
    ["Beam size", `up to ${limits.max_beam_size}`],
    ["Queue", `${formatNumber(limits.max_waiting)} waiting per model`],
    ["Timeout", `${formatNumber(limits.default_timeout_ms)} ms (max ${formatNumber(limits.max_timeout_ms)})`],
  ];
  previous = null;
  loop(); // the rows' figures now, if the view is shown
  $("server-limits").replaceChildren(
    ...entries.flatMap(([term, value]) => {
      const dt = document.createElement("dt");
      dt.textContent = term;
      const dd = document.createElement("dd");
      dd.textContent = value;
      return [dt, dd];
    }),
  );
}

function show(id, text) {
  $(id).textContent = text;
}

function perSecond(value) {
  return value === null ? "–" : formatNumber(value, value < 10 ? 1 : 0);
}

function ttftText(ttft) {
  return ttft === null ? "–" : `${formatNumber(ttft.ms)} ms`;
}

async function refresh() {
  let now;
  try {
    const text = await (await call("metrics")).text();
    now = { at: performance.now(), samples: parseMetrics(text) };
  } catch (error) {
    show("server-updated", `Could not read /metrics: ${error.message}`);
    return;
  }
  show("fig-running", formatNumber(total(now.samples, "attnserve_requests_running")));
  show("fig-waiting", formatNumber(total(now.samples, "attnserve_requests_waiting")));
  show("fig-tokens", perSecond(rate(now, "attnserve_output_tokens_total", null)));
  const ttft = timeToFirstToken(now, null);
  show("fig-ttft", ttftText(ttft));
  $("fig-ttft").title = ttft && !ttft.recent ? "mean since the server started" : "";
  for (const row of $("models-body").rows) {
    const model = row.dataset.model;
    const cells = row.cells;
    const running = total(now.samples, "attnserve_requests_running", model);
    const waiting = total(now.samples, "attnserve_requests_waiting", model);
    cells[6].textContent = `${formatNumber(running)} / ${formatNumber(waiting)}`;
    cells[7].textContent = perSecond(rate(now, "attnserve_output_tokens_total", model));
    cells[8].textContent = ttftText(timeToFirstToken(now, model));
  }
  previous = now;
  show("server-updated", `Updated ${new Date().toLocaleTimeString()} from /metrics, every ${REFRESH_MS / 1000} s.`);
}

// One refresh now, the next in REFRESH_MS; a later call takes over (the older one stops).
async function loop() {
  const run = ++loops;
  clearTimeout(timer);
  if (!$("view-server").hidden && document.visibilityState === "visible") await refresh();
  if (run === loops) timer = setTimeout(loop, REFRESH_MS);
}

export function start() {
  loop();
}
