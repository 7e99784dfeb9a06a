// Calls to attnserve's API: the API key, errors as the server words them, Server-Sent Events.

const KEY = "attnserve-api-key";

export function apiKey() {
  return sessionStorage.getItem(KEY) || "";
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY, key);
  else sessionStorage.removeItem(KEY);
}

// An answer that was not 2xx (or a stream's error event): `message` is the server's words.
export class ApiError extends Error {
  constructor(status, message, retryAfter = null) {
    super(message);
    this.status = status;
    this.retryAfter = retryAfter;
  }

  get needsKey() {
    return this.status === 401 || this.status === 403;
  }
}

// The text of an error body: {"error": {"message": ...}} (native and OpenAI routes) or
// {"error": "..."} (LibreTranslate's routes).
export function errorText(body) {
  const error = body && body.error;
  if (typeof error === "string") return error;
  if (error && typeof error.message === "string") return error.message;
  return null;
}

async function failure(response) {
  let message = null;
  try {
    message = errorText(await response.json());
  } catch {
    // not JSON: the status line says it
  }
  message = message || `${response.status} ${response.statusText}`.trim();
  const retryAfter = response.headers.get("Retry-After");
  if (response.status === 429) {
    message = `Busy, retry in ${retryAfter || "a few"} s (${message})`;
  }
  const error = new ApiError(response.status, message, retryAfter);
  if (error.needsKey) {
    window.dispatchEvent(new CustomEvent("attnserve:needs-key", { detail: error }));
  }
  return error;
}

// fetch() with the key and a JSON body; throws ApiError unless the answer is 2xx. Paths are
// relative to the page (a proxy may serve attnserve under a prefix).
export async function call(path, { body, signal, method } = {}) {
  const headers = {};
  const key = apiKey();
  if (key) headers.Authorization = `Bearer ${key}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, {
    method: method || (body === undefined ? "GET" : "POST"),
    headers,
    body: body === undefined ? undefined : JSON.stringify(body),
    signal,
    cache: "no-store",
  });
  if (!response.ok) throw await failure(response);
  return response;
}

export async function callJson(path, options) {
  return (await call(path, options)).json();
}

// The `data:` payloads of a text/event-stream answer, one string per event.
export async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (data) yield data;
    }
  }
}

// Parsed events of a stream until [DONE]; an {"error": ...} event throws ApiError.
export async function* jsonEvents(response) {
  for await (const data of events(response)) {
    if (data === "[DONE]") return;
    const event = JSON.parse(data);
    const message = errorText(event);
    if (message !== null) throw new ApiError(0, message);
    yield event;
  }
}

export function isAbort(error) {
  return error && error.name === "AbortError";
}

export function formatNumber(value, digits = 0) {
  return Number(value).toLocaleString("en", {
    minimumFractionDigits: digits,
    maximumFractionDigits: digits,
  });
}
