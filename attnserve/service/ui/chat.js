// The Chat view: OpenAI's /v1/chat/completions with stream: true. The conversation lives in
// the page; Stop aborts the fetch, and the server cancels the request when the client goes.

import { call, formatNumber, isAbort, jsonEvents } from "./api.js";

const $ = (id) => document.getElementById(id);

let info = null;
let messages = []; // {role, content, note?}
let controller = null;

function languageModels() {
  return info ? info.models.filter((m) => m.kind === "generation") : [];
}

export function init(serverInfo) {
  info = serverInfo;
  const models = languageModels();
  const select = $("chat-model");
  const previous = select.value;
  select.replaceChildren(
    ...models.map((m) => {
      const option = document.createElement("option");
      option.value = m.name;
      option.textContent = m.name;
      return option;
    }),
  );
  if (models.some((m) => m.name === previous)) select.value = previous;
  $("chat-send").disabled = models.length === 0;
  showError(models.length ? "" : "No language model is served: see the Translate view.");
  limitTokens();
}

function model() {
  return languageModels().find((m) => m.name === $("chat-model").value) || null;
}

function limitTokens() {
  const chosen = model();
  if (!chosen) return;
  const input = $("chat-max-tokens");
  input.max = String(chosen.max_new_tokens);
  if (Number(input.value) > chosen.max_new_tokens) input.value = String(chosen.max_new_tokens);
}

function showError(message) {
  const box = $("chat-error");
  box.textContent = message || "";
  box.hidden = !message;
}

function messageItem(message) {
  const item = document.createElement("li");
  item.className = `message ${message.role}`;
  const role = document.createElement("span");
  role.className = "role";
  role.textContent = message.role === "user" ? "You" : "Assistant";
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = message.content;
  const note = document.createElement("span");
  note.className = "note";
  note.textContent = message.note || "";
  item.append(role, content, note);
  return item;
}

function render() {
  $("chat-log").replaceChildren(...messages.map(messageItem));
  const last = $("chat-log").lastElementChild;
  if (last) last.scrollIntoView({ block: "nearest" });
  const idle = controller === null;
  $("chat-clear").disabled = !idle || messages.length === 0;
  $("chat-regenerate").disabled = !idle || !messages.some((m) => m.role === "user");
}

function updateLast() {
  const item = $("chat-log").lastElementChild;
  const message = messages[messages.length - 1];
  if (!item || !message) return;
  item.querySelector(".content").textContent = message.content;
  item.querySelector(".note").textContent = message.note || "";
  item.scrollIntoView({ block: "nearest" });
}

function setBusy(busy) {
  $("chat-send").disabled = busy || languageModels().length === 0;
  $("chat-stop").hidden = !busy;
  $("chat-log").setAttribute("aria-busy", String(busy));
}

function responseFormat() {
  if (!$("chat-json").checked) return undefined;
  let schema;
  try {
    schema = JSON.parse($("chat-schema").value);
  } catch (error) {
    throw new Error(`The JSON schema is not JSON: ${error.message}`);
  }
  return { type: "json_schema", json_schema: { name: "answer", schema } };
}

function requestBody(chosen) {
  const system = $("chat-system").value.trim();
  const history = messages.map(({ role, content }) => ({ role, content }));
  const body = {
    model: chosen.name,
    messages: system ? [{ role: "system", content: system }, ...history] : history,
    stream: true,
    stream_options: { include_usage: true },
  };
  const temperature = Number.parseFloat($("chat-temperature").value);
  if (Number.isFinite(temperature)) body.temperature = temperature;
  const maxTokens = Number.parseInt($("chat-max-tokens").value, 10);
  if (Number.isFinite(maxTokens)) body.max_tokens = maxTokens;
  const format = responseFormat();
  if (format) body.response_format = format;
  return body;
}

// Streams the assistant's answer to the conversation as it is.
async function generate() {
  const chosen = model();
  if (!chosen || controller) return;
  showError("");
  let body;
  try {
    body = requestBody(chosen);
  } catch (error) {
    showError(error.message);
    return;
  }
  const answer = { role: "assistant", content: "", note: "…" };
  messages.push(answer);
  controller = new AbortController();
  setBusy(true);
  render();
  const started = performance.now();
  let firstToken = null;
  let finish = null;
  let usage = null;
  try {
    const response = await call("v1/chat/completions", { body, signal: controller.signal });
    for await (const chunk of jsonEvents(response)) {
      if (chunk.usage) usage = chunk.usage;
      const [choice] = chunk.choices || [];
      if (!choice) continue;
      if (choice.delta && choice.delta.content) {
        firstToken ??= performance.now();
        answer.content += choice.delta.content;
        updateLast();
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    }
    if ($("chat-json").checked) answer.content = pretty(answer.content);
    answer.note = summary(started, firstToken, usage, finish);
  } catch (error) {
    if (isAbort(error)) {
      answer.note = "Stopped";
    } else {
      messages.pop();
      showError(error.message);
    }
  } finally {
    controller = null;
    setBusy(false);
    render();
  }
}

function pretty(text) {
  try {
    return JSON.stringify(JSON.parse(text), null, 2);
  } catch {
    return text;
  }
}

function summary(started, firstToken, usage, finish) {
  const parts = [];
  if (usage) parts.push(`${formatNumber(usage.completion_tokens)} tokens`);
  parts.push(`${formatNumber((performance.now() - started) / 1000, 1)} s`);
  if (firstToken !== null) parts.push(`first token ${formatNumber(firstToken - started)} ms`);
  if (finish && finish !== "stop") parts.push(`finish: ${finish}`);
  return parts.join(" · ");
}

function send() {
  const input = $("chat-input");
  const text = input.value;
  if (!text.trim() || controller) return;
  messages.push({ role: "user", content: text });
  input.value = "";
  generate();
}

export function stop() {
  if (controller) controller.abort();
}

function regenerate() {
  if (controller) return;
  while (messages.length && messages[messages.length - 1].role === "assistant") messages.pop();
  if (messages.length) generate();
}

function clear() {
  if (controller) return;
  messages = [];
  showError("");
  render();
  $("chat-input").focus();
}

export function bind() {
  $("chat-form").addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  $("chat-input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  $("view-chat").addEventListener("keydown", (event) => {
    if (event.key === "Escape" && controller) stop();
  });
  $("chat-stop").addEventListener("click", stop);
  $("chat-regenerate").addEventListener("click", regenerate);
  $("chat-clear").addEventListener("click", clear);
  $("chat-model").addEventListener("change", limitTokens);
}
