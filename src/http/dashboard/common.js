// What every view shares: the bearer token (kept in this tab only), calls to
// the public API, what the caller may do, and small DOM builders. The page
// builds its DOM with these and never parses HTML from data.

export const TOKEN_KEY = "statehouse-token";
export const view = document.getElementById("view");
const notice = document.getElementById("notice");
const tokenForm = document.getElementById("token-form");

/**
 * Shows a view's nodes, unless the user has moved on to another view since
 * it began loading (`route`, the location's hash then): a slow answer
 * never replaces a newer view.
 */
export function show(route, ...nodes) {
  if (location.hash === route) view.replaceChildren(...nodes);
}

export function token() { return sessionStorage.getItem(TOKEN_KEY); }
export function say(text) { notice.textContent = text || ""; }

/**
 * Calls the public API; answers {status, body}. A 401 asks for a token, and
 * shows the Token button (tokens may have been turned on since the page loaded).
 */
export async function api(path, options = {}) {
  const headers = Object.assign({}, options.headers || {});
  if (token()) headers["Authorization"] = "Bearer " + token();
  if (options.body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, Object.assign({}, options, { headers }));
  const text = await response.text();
  let body = null;
  try { body = text ? JSON.parse(text) : null; } catch (_) { body = text; }
  if (response.status === 401) {
    document.getElementById("token-button").hidden = false;
    tokenForm.hidden = false;
    document.getElementById("token-input").focus();
  }
  return { status: response.status, body };
}

/** A refusal as the user reads it: the status, the problem's title and detail. */
export function problemText(reply) {
  const b = reply.body;
  const what = (b && b.detail) ? b.title + ": " + b.detail : "";
  return ("HTTP " + reply.status + " " + what).trim();
}

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (v !== undefined && v !== null && v !== false) node.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children) if (c !== null && c !== undefined) node.append(c);
  return node;
}

export function table(headers, rows, testid) {
  return el("table", { "data-testid": testid },
    el("thead", {}, el("tr", {}, ...headers.map(([h, cls]) => el("th", { class: cls, text: h })))),
    el("tbody", {}, ...rows));
}

/**
 * A table that a phone shows as one card per row (app.css): each cell is
 * labelled with its column's header, as the header row is then hidden.
 */
export function cardTable(headers, rows, testid) {
  for (const row of rows) {
    [...row.cells].forEach((cell, i) => cell.setAttribute("data-label", headers[i][0]));
  }
  const node = table(headers, rows, testid);
  node.classList.add("cards");
  return node;
}

/** A value of a lease's `info` as text: a string as is, anything else as JSON. */
function infoText(value) { return typeof value === "string" ? value : JSON.stringify(value); }

/**
 * A lease's `info`, key by key, as text (it is whatever the acquire sent):
 * a lock's holder and a pool's show it alike.
 */
export function infoList(info) {
  const entries = Object.entries(info || {});
  if (entries.length === 0) return el("span", { class: "muted", text: "(none)" });
  return el("dl", { class: "info", "data-testid": "info" }, ...entries.flatMap(([key, value]) => [
    el("dt", { text: key }),
    el("dd", { "data-key": key, text: infoText(value) })]));
}

export function statePath(id) { return "/v1/states/" + encodeURIComponent(id); }

/** A value as stored: JSON text, never locale-formatted. */
export function stored(value) { return value === undefined ? "(none)" : JSON.stringify(value); }

/**
 * A stream's bookmark in a history version read with `bookmarks=true`, as
 * stored: its value, or for a partitioned stream (whose own value is null)
 * each partition's context and value, as a 409 `bookmark-loss` names them.
 * "(none)" when the version has no bookmark for the stream, or no version.
 */
export function bookmarkText(version, stream) {
  if (!version) return stored(undefined);
  const value = (version.bookmarks || {})[stream];
  const partitions = (version.partitions || {})[stream] || [];
  if (value !== null || partitions.length === 0) return stored(value);
  return partitions.map((p) => stored(p.context) + ": " + stored(p.replication_key_value)).join("; ");
}

/**
 * Why the caller may not change state, or null when it may: the gateway's
 * answer to /v1/whoami. Without tokens everyone may.
 */
export async function whyReadOnly() {
  const me = await api("/v1/whoami");
  if (me.status !== 200) return "needs a write token";
  if (me.body.role === "read") return "needs a write token; yours is a read token";
  return null;
}

/**
 * A button that changes state: enabled for a caller that may write, else
 * disabled with the reason beside it (a screen reader hears it too).
 */
export function writeButton(readOnly, attrs, label) {
  const button = el("button", Object.assign({ type: "button", disabled: Boolean(readOnly), title: readOnly || undefined }, attrs), label);
  if (!readOnly) return button;
  const reasonId = "why-" + Math.random().toString(36).slice(2);
  button.setAttribute("aria-describedby", reasonId);
  return el("span", {}, button, el("span", { id: reasonId, class: "why", "data-testid": "why-disabled", text: readOnly }));
}
