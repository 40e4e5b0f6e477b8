// The Pools view: every pool someone holds or waits for (GET /v1/pools), how
// full it is, and who holds its slots. A pool's name, a holder's owner and
// its info are whatever clients sent: they are put on the page as text only.

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

/** "2 / 4": slots taken of the limit, marked when none is left. */
function heldCell(pool) {
  const full = pool.holders.length >= pool.limit;
  return el("td", { "data-testid": "held", class: full ? "full" : undefined,
    text: pool.holders.length + " / " + pool.limit + (full ? " (full)" : "") });
}

function summary(pools) {
  const rows = pools.map((p) => el("tr", { "data-testid": "pool-row", "data-pool": p.pool },
    el("td", { class: "id", text: p.pool }),
    el("td", { text: String(p.limit) }),
    heldCell(p),
    el("td", { "data-testid": "waiting", text: String(p.waiting) })));
  return el("section", {}, el("h2", { text: "Pools" }),
    el("p", { text: "Pools that someone holds or waits for, by name. Each grants at most its limit of leases at once." }),
    cardTable([["Pool"], ["Limit"], ["Held"], ["Waiting"]], rows, "pools"));
}

/** One pool's holders; on a phone each is a card, so a row never needs a sideways scroll. */
function holdersSection(pool) {
  const rows = pool.holders.map((h) => el("tr", { "data-testid": "pool-holder-row", "data-fencing-token": String(h.fencing_token) },
    el("td", { "data-testid": "holder-owner", text: h.owner }),
    el("td", { "data-testid": "holder-token", text: String(h.fencing_token) }),
    el("td", { text: h.acquired_at }),
    el("td", { text: h.expires_at }),
    el("td", { class: "id", text: h.gateway_id }),
    el("td", { "data-testid": "holder-info" }, infoList(h.info))));
  return el("section", { "data-testid": "pool", "data-pool": pool.pool },
    el("h2", { class: "name", "data-testid": "pool-name", text: pool.pool }),
    el("p", { class: "muted", text: pool.holders.length + " of " + pool.limit + " held, " + pool.waiting + " waiting." }),
    rows.length === 0 ? el("p", { text: "No lease of this pool runs now." })
      : cardTable([["Owner"], ["Fencing token"], ["Since"], ["Expires"], ["Gateway"], ["Info"]], rows, "pool-holders"));
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
