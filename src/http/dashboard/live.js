// Following changes live: one stream of the change feed for the whole page,
// which the open view listens to. The stream is `/v1/changes` as
// Server-Sent Events, read with fetch so that the token goes in a header
// and never in a URL (EventSource cannot send one). A stream whose answer
// has begun does not hold up a headless renderer's virtual time, as a
// long-poll would: the page still settles for `--dump-dom`.
//
// A dead stream is opened again from the last cursor, after a pause that
// grows to 10 s. A cursor too old for the gateway (410) means changes may
// have been missed: the view is told to read everything again.

import { token } from "./common.js";

/** Who hears of each change: (change | null) => void; null means "relist". */
const listeners = new Set();
/** The stream now open, aborted when the token changes. */
let current = null;

export function onChange(listener) {
  listeners.add(listener);
  return () => listeners.delete(listener);
}

function tell(change) {
  for (const listener of [...listeners]) listener(change);
}

function headers(extra = {}) {
  const all = Object.assign({}, extra);
  if (token()) all["Authorization"] = "Bearer " + token();
  return all;
}

/** The feed's cursor now, or null when the gateway refuses (no token yet). */
async function cursorNow(signal) {
  const response = await fetch("/v1/changes?pattern=*", { headers: headers(), signal });
  if (response.status !== 200) return null;
  return (await response.json()).cursor;
}

/**
 * Reads one stream from `cursor` until it ends; answers the last cursor
 * heard, or null when the cursor expired (410).
 */
async function follow(cursor, signal) {
  const query = new URLSearchParams({ pattern: "*", since: cursor });
  const response = await fetch("/v1/changes?" + query, {
    headers: headers({ Accept: "text/event-stream" }),
    signal,
  });
  if (response.status === 410) return null;
  if (response.status !== 200 || !response.body) throw new Error("feed: HTTP " + response.status);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return cursor;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = parseEvent(buffer.slice(0, end));
      buffer = buffer.slice(end + 2);
      if (event.id) cursor = event.id;
      if (event.type === "change" && event.data) tell(JSON.parse(event.data));
    }
  }
}

/** One SSE event's fields (comments, such as keep-alives, are skipped). */
function parseEvent(text) {
  const event = { type: "message", data: "", id: null };
  for (const line of text.split("\n")) {
    if (line.startsWith(":")) continue;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
    if (field === "event") event.type = value;
    else if (field === "data") event.data += (event.data ? "\n" : "") + value;
    else if (field === "id") event.id = value;
  }
  return event;
}

function pause(ms, signal) {
  return new Promise((resolve) => {
    const timer = setTimeout(resolve, ms);
    signal.addEventListener("abort", () => { clearTimeout(timer); resolve(); });
  });
}

/** Follows the feed until `signal` aborts, opening it again as it dies. */
async function run(signal) {
  let cursor = null;
  let backoff = 1000;
  while (!signal.aborted) {
    try {
      if (cursor === null) {
        cursor = await cursorNow(signal);
        if (cursor === null) { await pause(10000, signal); continue; }
      }
      const last = await follow(cursor, signal);
      if (last === null) tell(null);
      // A stream that ended after changes is opened again at once; one
      // that ended with none (a gateway stopping) after a pause.
      if (last !== null && last !== cursor) backoff = 1000;
      else await pause(backoff, signal);
      cursor = last;
    } catch (_) {
      if (signal.aborted) return;
      await pause(backoff, signal);
      backoff = Math.min(backoff * 2, 10000);
    }
  }
}

/** (Re)starts following with the token now set: call at load and on a token change. */
export function startFollowing() {
  if (current) current.abort();
  current = new AbortController();
  run(current.signal);
}
