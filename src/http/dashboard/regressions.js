// The Regressions view: the newest versions, across states, that moved a
// stream's bookmark backwards or dropped it, each with the values before and
// after (from the state's history) and who made the change.

import { api, bookmarkText, cardTable, el, problemText, say, show, statePath } from "./common.js";

/** How many states' histories the view reads for the values before and after. */
const STATES_READ = 20;

export async function renderRegressions() {
  const route = location.hash;
  const reply = await api("/v1/regressions?limit=100");
  if (reply.status !== 200) { say(problemText(reply)); show(route); return; }
  say("");
  const found = reply.body.regressions;
  const ids = [...new Set(found.map((r) => r.state_id))].slice(0, STATES_READ);
  const histories = new Map(await Promise.all(ids.map(async (id) => {
    const history = await api(statePath(id) + "/history?limit=200&bookmarks=true");
    return [id, history.status === 200 ? history.body.versions : []];
  })));
  const rows = [];
  for (const r of found) {
    const versions = histories.get(r.state_id) || [];
    const at = versions.findIndex((v) => v.version === r.version);
    const now = at >= 0 ? versions[at] : undefined;
    const before = at >= 0 ? versions[at + 1] : undefined;
    const row = (testid, stream, mark, after) =>
      el("tr", { "data-testid": testid, "data-state-id": r.state_id },
        el("td", { class: "id" }, el("a", { href: "#/state/" + encodeURIComponent(r.state_id), text: r.state_id })),
        el("td", {}, stream, mark),
        el("td", {}, el("code", { class: "old", text: before ? bookmarkText(before, stream) : "(older than the history read)" })),
        el("td", {}, after),
        el("td", { "data-testid": "actor", text: r.actor }),
        el("td", { text: r.version }));
    for (const stream of r.regressed_streams) {
      rows.push(row("regression-row", stream, el("span", { class: "regressed", text: " regressed" }),
        el("code", { class: "new", text: now ? bookmarkText(now, stream) : "" })));
    }
    for (const stream of r.lost_streams || []) {
      // A stream gone whole has no value after; a lost partition leaves the stream's other ones.
      rows.push(row("loss-row", stream, el("span", { class: "lost", "data-testid": "lost", text: " lost" }),
        el("code", { class: "new", text: bookmarkText(now, stream) })));
    }
  }
  const empty = rows.length === 0 ? el("p", { text: "No version has moved a bookmark backwards or dropped one." }) : null;
  show(route, el("section", {}, el("h2", { text: "Regressions" }),
    el("p", { text: "Versions that moved a stream's bookmark backwards (regressed) or dropped it (lost), newest first." }),
    empty ?? cardTable([["State"], ["Stream"], ["Before"], ["After"], ["Actor"], ["Version"]], rows, "regressions")));
}
