// The dashboard's entry: the token prompt, the router, and the list views
// (states, locks). The state page and the Regressions and Pools views are
// modules of their own.

import { TOKEN_KEY, api, cardTable, el, problemText, say, show, token } from "./common.js";
import { onChange, startFollowing } from "./live.js";
import { renderPools } from "./pools.js";
import { renderRegressions } from "./regressions.js";
import { renderState } from "./state.js";

const tokenForm = document.getElementById("token-form");

/**
 * The token controls: the Token button only on a gateway that asks for
 * tokens (/v1/whoami says so, or refuses the caller), so that a gateway
 * without them offers nothing to fill in.
 */
async function showAuth() {
  const has = Boolean(token());
  document.getElementById("auth-status").textContent = has ? "token set" : "";
  document.getElementById("forget-token").hidden = !has;
  const me = await api("/v1/whoami");
  document.getElementById("token-button").hidden = me.status === 200 && me.body.tokens === false;
}

/**
 * An age in words. A row stamped later than this browser's clock (the
 * browser's or the gateway's clock is off) is "ahead", never a negative age.
 */
function age(seconds) {
  if (seconds < 0) return "ahead";
  if (seconds < 90) return Math.round(seconds) + " s";
  if (seconds < 5400) return Math.round(seconds / 60) + " min";
  if (seconds < 172800) return Math.round(seconds / 3600) + " h";
  return Math.round(seconds / 86400) + " d";
}

async function locksById() {
  const reply = await api("/v1/locks");
  const map = new Map();
  if (reply.status === 200) for (const l of reply.body.locks) map.set(l.state_id, l);
  return map;
}

/** Each state's newest run by state_id, for the glob listed (none with history off). */
async function lastRuns(pattern) {
  const reply = await api("/v1/runs/latest?" + new URLSearchParams({ pattern }));
  const map = new Map();
  if (reply.status === 200) for (const l of reply.body.latest) map.set(l.state_id, l.run);
  return map;
}

/** A run's status, a failed or lost one marked. */
function lastRunCell(run) {
  if (!run) return el("td", { "data-testid": "last-run", text: "" });
  const bad = run.status === "failed" || run.status === "lost";
  return el("td", { "data-testid": "last-run", "data-status": run.status, class: bad ? "failed" : undefined,
    title: run.started_at, text: run.status });
}

let listing = { pattern: "*", cursors: [null] };

async function renderStates() {
  const route = location.hash;
  const staleHours = Number(sessionStorage.getItem("statehouse-stale-hours") || "24");
  const page = listing.cursors[listing.cursors.length - 1];
  const query = new URLSearchParams({ pattern: listing.pattern, limit: "50" });
  if (page) query.set("cursor", page);
  const [reply, locks, runs] = await Promise.all([api("/v1/states?" + query), locksById(), lastRuns(listing.pattern)]);
  if (reply.status !== 200) { say(problemText(reply)); show(route); return; }
  say("");
  const now = Date.now();
  const rows = reply.body.states.map((s) => {
    const seconds = (now - Date.parse(s.updated_at)) / 1000;
    const stale = seconds > staleHours * 3600;
    const lock = locks.get(s.state_id);
    return el("tr", { "data-testid": "state-row", "data-state-id": s.state_id },
      el("td", { class: "id" }, el("a", { href: "#/state/" + encodeURIComponent(s.state_id), text: s.state_id })),
      el("td", { class: "wide", text: s.updated_at }),
      el("td", { class: stale ? "stale" : "fresh", "data-testid": "age", text: age(seconds) + (stale ? " (stale)" : ""),
        title: seconds < 0 ? "stamped " + age(-seconds) + " after this browser's clock" : undefined }),
      el("td", { "data-testid": "lock", text: lock ? lock.owner + " until " + lock.expires_at : "" }),
      lastRunCell(runs.get(s.state_id)));
  });
  const filter = el("form", { class: "row", "data-testid": "filter", onsubmit: (e) => {
      e.preventDefault();
      listing = { pattern: e.target.pattern.value || "*", cursors: [null] };
      sessionStorage.setItem("statehouse-stale-hours", e.target.stale.value || "24");
      renderStates();
    } },
    el("label", {}, "Glob", el("input", { name: "pattern", value: listing.pattern, "data-testid": "pattern" })),
    el("label", {}, "Stale after (hours)", el("input", { name: "stale", type: "number", min: "0", step: "any", value: String(staleHours), "data-testid": "stale-hours" })),
    el("button", { type: "submit", text: "Filter" }));
  const next = reply.body.next_cursor;
  const paging = el("div", { class: "row" },
    el("button", { type: "button", disabled: listing.cursors.length === 1, text: "First page",
      onclick: () => { listing.cursors = [null]; renderStates(); } }),
    el("button", { type: "button", disabled: !next, "data-testid": "next-page", text: "Next page",
      onclick: () => { listing.cursors.push(next); renderStates(); } }));
  show(route, el("section", {}, el("h2", { text: "States" }), filter,
    cardTable([["State"], ["Updated", "wide"], ["Age"], ["Lock"], ["Last run"]], rows, "states"), paging));
}

async function renderLocks() {
  const route = location.hash;
  const reply = await api("/v1/locks");
  if (reply.status !== 200) { say(problemText(reply)); show(route); return; }
  say("");
  const rows = reply.body.locks.map((l) => el("tr", { "data-testid": "lock-row" },
    el("td", { class: "id" }, el("a", { href: "#/state/" + encodeURIComponent(l.state_id), text: l.state_id })),
    el("td", { text: l.owner }), el("td", { text: String(l.fencing_token) }),
    el("td", { text: l.expires_at }), el("td", { text: l.gateway_id })));
  show(route, el("section", {}, el("h2", { text: "Locks" }),
    cardTable([["State"], ["Owner"], ["Fencing token"], ["Expires"], ["Gateway"]], rows, "locks")));
}

function route() {
  const hash = location.hash || "#/";
  let current = "states";
  if (hash.startsWith("#/state/")) {
    // An id is encoded in the hash, so the first "?" starts the page's own query (at=).
    const [id, query] = hash.slice(8).split("?");
    current = "state";
    renderState(decodeURIComponent(id), new URLSearchParams(query || "").get("at"));
  }
  else if (hash === "#/locks") { current = "locks"; renderLocks(); }
  else if (hash === "#/pools") { current = "pools"; renderPools(); }
  else if (hash === "#/regressions") { current = "regressions"; renderRegressions(); }
  else renderStates();
  for (const a of document.querySelectorAll("nav a")) {
    if (a.dataset.view === current) a.setAttribute("aria-current", "page"); else a.removeAttribute("aria-current");
  }
}

// The open view follows the feed: the States list on any change (a new
// state may belong on its page), a state's page on its own. A burst of
// changes renders once, and never under the user's typing.
let rerender = null;
function rerenderSoon() {
  if (rerender) return;
  rerender = setTimeout(() => {
    rerender = null;
    const typing = document.activeElement && document.activeElement.closest("#view form");
    if (typing) rerenderSoon(); else route();
  }, 300);
}
onChange((change) => {
  const hash = location.hash || "#/";
  if (hash === "#/") rerenderSoon();
  else if (hash.startsWith("#/state/")) {
    if (!change || change.state_id === decodeURIComponent(hash.slice(8))) rerenderSoon();
  }
});

tokenForm.addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, document.getElementById("token-input").value.trim());
  document.getElementById("token-input").value = "";
  tokenForm.hidden = true;
  showAuth();
  route();
  startFollowing();
});
document.getElementById("token-button").addEventListener("click", () => { tokenForm.hidden = !tokenForm.hidden; });
document.getElementById("forget-token").addEventListener("click", () => { sessionStorage.removeItem(TOKEN_KEY); showAuth(); route(); startFollowing(); });
window.addEventListener("hashchange", route);
showAuth();
route();
startFollowing();
