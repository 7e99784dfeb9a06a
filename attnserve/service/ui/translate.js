// The Translate view: streamed through /v1/generate (one text, greedy), or answered whole by
// /v1/translate (HTML, or beam search with alternatives); "Detect language" asks /detect.

import { call, callJson, formatNumber, isAbort, jsonEvents } from "./api.js";

const $ = (id) => document.getElementById(id);
const DETECT_DELAY_MS = 600;
const DETECT_CHARS = 2000; // what the server reads of a text to detect its language
const BODY_OVERHEAD = 512; // bytes of a request's other fields
const ALTERNATIVES = 3;

let info = null;
let detected = null; // {language, confidence} of the text as it is now, or null
let detectTimer = 0;
let detectRun = 0;
let controller = null;

function sameLanguage(a, b) {
  const base = (code) => String(code).toLowerCase().split(/[-_]/)[0];
  return a != null && b != null && base(a) === base(b);
}

function languageName(code) {
  return (info && info.languages[code]) || code;
}

function translationModels() {
  return info ? info.models.filter((m) => m.kind === "translation") : [];
}

function options(select, entries, keep) {
  const previous = keep ? select.value : null;
  select.replaceChildren(
    ...entries.map(([value, label]) => {
      const option = document.createElement("option");
      option.value = value;
      option.textContent = label;
      return option;
    }),
  );
  if (previous !== null && entries.some(([value]) => value === previous)) select.value = previous;
}

function byName(codes) {
  return [...new Set(codes)]
    .sort((a, b) => languageName(a).localeCompare(languageName(b)))
    .map((code) => [code, `${languageName(code)} (${code})`]);
}

export function init(serverInfo) {
  info = serverInfo;
  const models = translationModels();
  const view = $("view-translate");
  view.classList.toggle("empty", models.length === 0);
  if (models.length === 0) {
    showError("No translation model is served: see the Chat view.");
    $("translate").disabled = true;
    return;
  }
  const sources = models.flatMap((m) => m.source_languages || m.target_languages);
  const targets = models.flatMap((m) => m.target_languages);
  options($("source-lang"), [["auto", "Detect language"], ...byName(sources)], true);
  options($("target-lang"), byName(targets), true);
  const chosen = models.find((m) => m.default) || models[0];
  if (!$("target-lang").dataset.touched && chosen.target_languages.length) {
    $("target-lang").value = chosen.target_languages[0];
  }
  $("translate-model-field").hidden = models.length < 2;
  options($("translate-model"), [["", "Automatic"], ...models.map((m) => [m.name, m.name])], true);
  $("translate").disabled = false;
  countCharacters();
}

// The model for source -> target: the one picked, else the first that translates into the
// target (and from the source, when it is known), as LibreTranslate's /translate chooses.
function chooseModel(source, target) {
  const models = translationModels();
  const picked = $("translate-model").value;
  if (picked) return models.find((m) => m.name === picked) || null;
  const into = models.filter((m) => m.target_languages.some((t) => sameLanguage(t, target)));
  if (source === null) return into[0] || null;
  return (
    into.find(
      (m) => !m.source_languages || m.source_languages.some((s) => sameLanguage(s, source)),
    ) || null
  );
}

function showError(message) {
  const box = $("translate-error");
  box.textContent = message || "";
  box.hidden = !message;
}

function bodyBytes(text) {
  return new TextEncoder().encode(JSON.stringify(text)).length + BODY_OVERHEAD;
}

function countCharacters() {
  const text = $("source-text").value;
  const count = $("char-count");
  const characters = [...text].length;
  if (!info) {
    count.textContent = `${formatNumber(characters)} characters`;
    return true;
  }
  const limit = info.limits.max_body_bytes;
  const fits = bodyBytes(text) <= limit;
  count.textContent = `${formatNumber(characters)} / ${formatNumber(limit - BODY_OVERHEAD)} characters`;
  count.title = "The limit is the server's max_body_bytes: a character outside ASCII counts 2 to 4.";
  count.classList.toggle("over", !fits);
  return fits;
}

function showDetected(text) {
  $("detected").textContent = text;
}

// /detect on the text as typed (debounced); the last call wins.
async function detect() {
  const text = $("source-text").value;
  const run = ++detectRun;
  if ($("source-lang").value !== "auto" || !text.trim()) {
    detected = null;
    showDetected("");
    return null;
  }
  try {
    const ranked = await callJson("detect", { body: { q: text.slice(0, DETECT_CHARS) } });
    if (run !== detectRun) return detected;
    detected = ranked[0] || null;
    showDetected(
      detected
        ? `Detected: ${languageName(detected.language)} (${formatNumber(detected.confidence)}%)`
        : "",
    );
  } catch (error) {
    if (run !== detectRun) return detected;
    detected = null;
    showDetected(error.needsKey ? "" : `Not detected: ${error.message}`);
  }
  return detected;
}

function scheduleDetect() {
  clearTimeout(detectTimer);
  detectTimer = setTimeout(detect, DETECT_DELAY_MS);
}

function setBusy(busy) {
  $("translate").disabled = busy;
  $("translate-stop").hidden = !busy;
  $("target-text").setAttribute("aria-busy", String(busy));
  if (!busy) controller = null;
}

function setOutput(text) {
  $("target-text").textContent = text;
  $("copy").disabled = !text;
}

function showAlternatives(texts) {
  const list = $("alternatives-list");
  list.replaceChildren(
    ...texts.map((text) => {
      const item = document.createElement("li");
      item.textContent = text;
      return item;
    }),
  );
  $("alternatives").hidden = texts.length === 0;
}

export async function translate() {
  const text = $("source-text").value;
  if (controller || !info) return;
  showError("");
  showAlternatives([]);
  if (!text.trim()) {
    showError("Nothing to translate: type or paste a text.");
    return;
  }
  if (!countCharacters()) {
    showError("The text is larger than the server accepts (max_body_bytes): send it in parts.");
    return;
  }
  const source = $("source-lang").value;
  const target = $("target-lang").value;
  controller = new AbortController();
  setBusy(true);
  const started = performance.now();
  try {
    let from = source === "auto" ? null : source;
    if (source === "auto") {
      clearTimeout(detectTimer);
      from = (await detect())?.language || null;
    }
    const model = chooseModel(from, target);
    if (!model) {
      const what = from ? `from ${languageName(from)} into` : "into";
      throw new Error(`No served model translates ${what} ${languageName(target)}.`);
    }
    const body = {
      model: model.name,
      text,
      target_lang: target,
      source_lang: source,
    };
    const html = $("opt-html").checked;
    const beam = $("opt-alternatives").checked;
    let summary = "";
    if (html || beam) {
      summary = await translateWhole(body, model, html, beam, controller.signal);
    } else {
      summary = await translateStream(body, controller.signal);
    }
    const seconds = (performance.now() - started) / 1000;
    $("translate-info").textContent = `${summary} · ${formatNumber(seconds, 1)} s · ${model.name}`;
  } catch (error) {
    if (isAbort(error)) {
      $("translate-info").textContent = "Stopped";
    } else {
      showError(error.message);
    }
  } finally {
    setBusy(false);
  }
}

async function translateStream(body, signal) {
  setOutput("");
  $("translate-info").textContent = "Translating…";
  const response = await call("v1/generate", {
    body: { ...body, stream: true, beam_size: 1 },
    signal,
  });
  let text = "";
  for await (const event of jsonEvents(response)) {
    if ("finish_reason" in event) {
      setOutput(event.text);
      return `${formatNumber(event.output_tokens)} tokens`;
    }
    text += event.text;
    setOutput(text);
  }
  return "";
}

async function translateWhole(body, model, html, beam, signal) {
  $("translate-info").textContent = "Translating…";
  const request = { ...body, format: html ? "html" : "text" };
  if (beam) {
    const width = Math.min(Math.max(model.beam_size, 4), info.limits.max_beam_size);
    request.beam_size = width;
    request.num_hypotheses = Math.min(ALTERNATIVES + 1, width);
  }
  const answer = await callJson("v1/translate", { body: request, signal });
  const [first] = answer.translations;
  setOutput(first.text);
  if (first.detected_language) {
    const { language, confidence } = first.detected_language;
    showDetected(`Detected: ${languageName(language)} (${formatNumber(confidence * 100)}%)`);
  }
  if (beam && first.hypotheses) showAlternatives(first.hypotheses.slice(1).map((h) => h.text));
  return `${formatNumber(first.output_tokens)} tokens`;
}

export function stop() {
  if (controller) controller.abort();
}

function swap() {
  const sourceSelect = $("source-lang");
  const targetSelect = $("target-lang");
  const source = sourceSelect.value === "auto" ? detected?.language : sourceSelect.value;
  if (!source) {
    showError("Swap needs a source language: pick one, or type a text to detect it.");
    return;
  }
  const target = targetSelect.value;
  const hasOption = (select, code) => [...select.options].some((o) => o.value === code);
  if (!hasOption(sourceSelect, target) || !hasOption(targetSelect, source)) {
    showError(`No served model translates from ${languageName(target)} into ${languageName(source)}.`);
    return;
  }
  showError("");
  sourceSelect.value = target;
  targetSelect.value = source;
  const output = $("target-text").textContent;
  if (output) {
    setOutput($("source-text").value);
    $("source-text").value = output;
  }
  detected = null;
  showDetected("");
  countCharacters();
}

async function copy() {
  const text = $("target-text").textContent;
  const button = $("copy");
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    // no clipboard API (a page served over plain HTTP to another host): a selection
    const area = document.createElement("textarea");
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  button.textContent = "Copied";
  setTimeout(() => {
    button.textContent = "Copy";
  }, 1500);
}

export function bind() {
  $("translate").addEventListener("click", translate);
  $("translate-stop").addEventListener("click", stop);
  $("swap").addEventListener("click", swap);
  $("copy").addEventListener("click", copy);
  $("source-text").addEventListener("input", () => {
    countCharacters();
    scheduleDetect();
  });
  $("source-lang").addEventListener("change", () => {
    detected = null;
    showDetected("");
    scheduleDetect();
  });
  $("target-lang").addEventListener("change", (event) => {
    event.target.dataset.touched = "1";
  });
  $("view-translate").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
      event.preventDefault();
      translate();
    } else if (event.key === "Escape" && controller) {
      stop();
    }
  });
}
