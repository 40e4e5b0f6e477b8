// The Pools view: every pool someone holds or waits for (GET /v1/pools), how
// many of its slots are used, who holds them, and who waits in what order
// (by priority). A pool's name, a holder's owner and its info are whatever
// clients sent: they are put on the page as text only.

import { api, cardTable, el, infoList, problemText, say, show } from "./common.js";

/**
 * How many pools the view then reads one by one. The listing counts waiters
 * only for the pools the gateway it reaches is the authority for (acquires
 * wait at the authority); a pool's own GET is answered by its authority.
 */
const EXACT = 50;

/** The pool as its authority sees it; null once nobody holds or waits for it. */
async function exact(listed) {
  const reply = await api("/v1/pools/" + encodeURIComponent(listed.pool));
  if (reply.status === 200) return reply.body;
  return reply.status === 404 ? null : listed;
}

/** "3 / 4": slots used of the limit, marked when none is left. */
function heldCell(pool) {
  const full = pool.used >= pool.limit;
  return el("td", { "data-testid": "held", class: full ? "full" : undefined,
    text: pool.used + " / " + pool.limit + (full ? " (full)" : "") });
}

/** "2 (priority 10, 0)": how many wait, and their priorities in line order. */
function waitingCell(pool) {
  const priorities = pool.waiters.map((w) => String(w.priority));
  const text = String(pool.waiting) + (priorities.length ? " (priority " + priorities.join(", ") + ")" : "");
  return el("td", { "data-testid": "waiting", text });
}

function summary(pools) {
  const rows = pools.map((p) => el("tr", { "data-testid": "pool-row", "data-pool": p.pool },
    el("td", { class: "id", text: p.pool }),
    el("td", { text: String(p.limit) }),
    heldCell(p),
    waitingCell(p)));
  return el("section", {}, el("h2", { text: "Pools" }),
    el("p", { text: "Pools that someone holds or waits for, by name. Each lease holds some of its pool's slots, never more than its limit in all; waiters go by priority, highest first." }),
    cardTable([["Pool"], ["Limit"], ["Slots used"], ["Waiting"]], rows, "pools"));
}

/** One pool's holders; on a phone each is a card, so a row never needs a sideways scroll. */
function holdersSection(pool) {
  const rows = pool.holders.map((h) => el("tr", { "data-testid": "pool-holder-row", "data-fencing-token": String(h.fencing_token) },
    el("td", { "data-testid": "holder-owner", text: h.owner }),
    el("td", { "data-testid": "holder-token", text: String(h.fencing_token) }),
    el("td", { "data-testid": "holder-slots", text: String(h.slots) }),
    el("td", { text: h.acquired_at }),
    el("td", { text: h.expires_at }),
    el("td", { class: "id", text: h.gateway_id }),
    el("td", { "data-testid": "holder-info" }, infoList(h.info))));
  return el("section", { "data-testid": "pool", "data-pool": pool.pool },
    el("h2", { class: "name", "data-testid": "pool-name", text: pool.pool }),
    el("p", { class: "muted", text: pool.used + " of " + pool.limit + " slots used, " + pool.waiting + " waiting." }),
    rows.length === 0 ? el("p", { text: "No lease of this pool runs now." })
      : cardTable([["Owner"], ["Fencing token"], ["Slots"], ["Since"], ["Expires"], ["Gateway"], ["Info"]], rows, "pool-holders"),
    waitersTable(pool));
}

/** The waiters in the order they will be granted: highest priority first, then arrival. */
function waitersTable(pool) {
  if (pool.waiters.length === 0) return null;
  const rows = pool.waiters.map((w, i) => el("tr", { "data-testid": "pool-waiter-row" },
    el("td", { text: String(i + 1) }),
    el("td", { "data-testid": "waiter-priority", text: String(w.priority) }),
    el("td", { "data-testid": "waiter-slots", text: String(w.slots) })));
  return cardTable([["Next"], ["Priority"], ["Slots"]], rows, "pool-waiters");
}

export async function renderPools() {
  const route = location.hash;
  const reply = await api("/v1/pools");
  if (reply.status !== 200) { say(problemText(reply)); show(route); return; }
  say("");
  const listed = reply.body.pools;
  const read = await Promise.all(listed.slice(0, EXACT).map(exact));
  const pools = read.filter((p) => p !== null).concat(listed.slice(EXACT));
  if (pools.length === 0) {
    show(route, el("section", {}, el("h2", { text: "Pools" }), el("p", { "data-testid": "no-pools", text: "No pool is in use." })));
    return;
  }
  show(route, summary(pools), ...pools.map(holdersSection));
}
