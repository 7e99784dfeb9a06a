// The page: its three views as tabs (#translate, #chat, #server), the API key, and what the
// server serves (/v1/server), read once the key (if any) is accepted.

import { apiKey, callJson, setApiKey } from "./api.js";
import * as chat from "./chat.js";
import * as server from "./server.js";
import * as translate from "./translate.js";

const $ = (id) => document.getElementById(id);
const VIEWS = ["translate", "chat", "server"];

function showView(name, focus = false) {
  const view = VIEWS.includes(name) ? name : VIEWS[0];
  for (const other of VIEWS) {
    const tab = $(`tab-${other}`);
    const selected = other === view;
    tab.setAttribute("aria-selected", String(selected));
    tab.tabIndex = selected ? 0 : -1;
    $(`view-${other}`).hidden = !selected;
  }
  if (focus) $(`tab-${view}`).focus();
  if (view === "server") server.start();
}

function bindTabs() {
  for (const name of VIEWS) {
    $(`tab-${name}`).addEventListener("click", () => {
      history.replaceState(null, "", `#${name}`);
      showView(name);
    });
  }
  // Arrow keys, Home and End move between the tabs (the WAI-ARIA tabs pattern).
  $("tab-translate").parentElement.addEventListener("keydown", (event) => {
    const current = VIEWS.findIndex((name) => $(`tab-${name}`) === document.activeElement);
    if (current < 0) return;
    const moves = {
      ArrowRight: current + 1,
      ArrowLeft: current - 1 + VIEWS.length,
      Home: 0,
      End: VIEWS.length - 1,
    };
    if (!(event.key in moves)) return;
    event.preventDefault();
    const name = VIEWS[moves[event.key] % VIEWS.length];
    history.replaceState(null, "", `#${name}`);
    showView(name, true);
  });
  window.addEventListener("hashchange", () => showView(location.hash.slice(1)));
}

function status(message) {
  const box = $("global-status");
  box.textContent = message || "";
  box.hidden = !message;
}

function askForKey(message, required = true) {
  $("key-message").textContent = message;
  $("key-input").required = required;
  $("key-panel").hidden = false;
  $("key-input").focus();
}

function bindKey() {
  window.addEventListener("attnserve:needs-key", (event) => {
    const refused = apiKey() !== "";
    askForKey(
      refused
        ? `The API key was refused: ${event.detail.message}`
        : "This server needs an API key.",
    );
  });
  $("key-panel").addEventListener("submit", (event) => {
    event.preventDefault();
    setApiKey($("key-input").value.trim());
    $("key-input").value = "";
    $("key-panel").hidden = true;
    load();
  });
  $("key-toggle").addEventListener("click", () => {
    askForKey("Change the API key (empty: forget it).", false);
  });
}

async function load() {
  let info;
  try {
    info = await callJson("v1/server");
  } catch (error) {
    if (error.needsKey) {
      status("");
      return; // the key panel asks for it
    }
    if (error.status === 503 && error.retryAfter) {
      status(`${error.message}: retrying in ${error.retryAfter} s…`);
      setTimeout(load, Number(error.retryAfter) * 1000);
      return;
    }
    status(error.message);
    return;
  }
  status("");
  $("key-toggle").hidden = apiKey() === "";
  translate.init(info);
  chat.init(info);
  server.init(info);
}

translate.bind();
chat.bind();
bindTabs();
bindKey();
showView(location.hash.slice(1));
load();
