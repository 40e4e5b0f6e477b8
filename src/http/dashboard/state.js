// The state page: who holds its lock and the lock's past leases, its runs, its
// bookmarks (each with a reset), the charts of its bookmarks over time, its
// document, and its versions, each with what it changed and a way back to it.

import { api, bookmarkText, cardTable, el, infoList, problemText, say, show, statePath, stored, table, view, whyReadOnly, writeButton } from "./common.js";
import { bookmarkCharts } from "./chart.js";
import { runsSection } from "./runs.js";

/** A glob that matches `id` itself (and maybe a few more, filtered out after). */
function globFor(id) { return id.replace(/[*?]/g, "?"); }

/** Asks, then sends a change; shows a refusal (401, 403, 409...) as such. */
async function change(question, path, options, id) {
  if (!confirm(question)) return;
  const reply = await api(path, options);
  if (reply.status >= 300) { say(problemText(reply)); return; }
  renderState(id);
}

function lockSection(id, lock, readOnly) {
  const section = el("section", {}, el("h2", { text: id, "data-testid": "state-title" }));
  if (lock.status !== 200) return section;
  const l = lock.body;
  const reason = el("input", { name: "reason", maxlength: "512", disabled: Boolean(readOnly), "data-testid": "unlock-reason" });
  const unlock = () => {
    const query = reason.value.trim() ? "?" + new URLSearchParams({ reason: reason.value.trim() }) : "";
    change("Force-unlock " + id + "? Its holder loses the lease.", "/v1/locks/" + encodeURIComponent(id) + query, { method: "DELETE" }, id);
  };
  section.append(
    el("div", { "data-testid": "lock-holder" },
      el("h3", { text: "Locked by " + l.owner }),
      el("dl", { class: "holder" },
        el("dt", { text: "Owner" }), el("dd", { "data-testid": "holder-owner", text: l.owner }),
        el("dt", { text: "Fencing token" }), el("dd", { "data-testid": "holder-token", text: String(l.fencing_token) }),
        el("dt", { text: "Acquired" }), el("dd", { text: l.acquired_at }),
        el("dt", { text: "Expires" }), el("dd", { text: l.expires_at }),
        el("dt", { text: "Lock-delay" }), el("dd", { text: l.lock_delay_seconds + " s" }),
        el("dt", { text: "Info" }), el("dd", { "data-testid": "holder-info" }, infoList(l.info)))),
    el("div", { class: "row" },
      el("label", {}, "Reason (kept in the lock's history)", reason),
      writeButton(readOnly, { class: "danger", "data-testid": "force-unlock", onclick: unlock }, "Force-unlock")));
  return section;
}

/** The word "lost" next to a stream's name, for a stream whose newest version dropped a bookmark. */
function lostMark() { return el("span", { class: "lost", "data-testid": "lost", text: " lost" }); }

/** The streams the newest version dropped: `lost` names them, `before` (the version before) has the values they had. */
function bookmarksSection(id, marks, regressed, lost, before, readOnly) {
  const current = marks.body.bookmarks.filter((b) => b.state_id === id && b.stream !== null);
  const rows = current.map((b) =>
    el("tr", { "data-testid": "bookmark-row", "data-stream": b.stream },
      el("td", {}, b.stream, regressed.has(b.stream) || b.last_change_regressed
        ? el("span", { class: "regressed", "data-testid": "regressed", text: " regressed" }) : null,
        lost.has(b.stream) ? lostMark() : null),
      el("td", { class: "wide", text: b.replication_key === null ? "" : stored(b.replication_key) }),
      el("td", { text: b.replication_key_value === null ? "" : stored(b.replication_key_value) }),
      el("td", { class: "wide" }, el("pre", { text: JSON.stringify(b.bookmark) })),
      el("td", {}, writeButton(readOnly, { "data-testid": "reset-stream", onclick: () =>
        change("Reset stream " + b.stream + " of state " + id + "? Its next run starts that stream from the beginning.",
          statePath(id) + "/bookmarks/" + encodeURIComponent(b.stream), { method: "DELETE" }, id) }, "Reset"))));
  // A stream gone whole has no row of its own any more: it gets one saying so, with the value it had.
  const present = new Set(current.map((b) => b.stream));
  for (const stream of [...lost].filter((s) => !present.has(s))) {
    rows.push(el("tr", { "data-testid": "bookmark-row", "data-stream": stream },
      el("td", {}, stream, lostMark()),
      el("td", { class: "wide" }),
      el("td", {}, el("code", { class: "old", text: bookmarkText(before, stream) })),
      el("td", { class: "wide" }),
      el("td")));
  }
  return el("section", {}, el("h2", { text: "Bookmarks" }),
    table([["Stream"], ["Replication key", "wide"], ["Value"], ["Bookmark", "wide"], [""]], rows, "bookmarks"));
}

/** What `version` changed, stream by stream: the value before and after, as stored. */
function diffOf(version, before) {
  const items = version.changed_streams.map((stream) =>
    el("li", { "data-testid": "diff-stream" },
      el("span", { text: stream + ": " }),
      el("code", { class: "old", "data-testid": "old", text: bookmarkText(before, stream) }),
      el("span", { "aria-hidden": "true", text: " → " }),
      el("code", { class: "new", "data-testid": "new", text: bookmarkText(version, stream) }),
      version.regressed_streams.includes(stream) ? el("span", { class: "regressed", text: " regressed" }) : null,
      (version.lost_streams || []).includes(stream) ? lostMark() : null));
  return el("ul", { class: "diff", "data-testid": "diff" }, ...items);
}

function historySection(id, versions, readOnly) {
  const rows = versions.map((v, i) => el("tr", { "data-testid": "version-row", "data-version": v.version },
    el("td", {}, el("a", { "data-testid": "as-of-link", href: stateHash(id, v.version), text: v.version })),
    el("td", { text: v.operation + (v.deleted ? " (deleted)" : "") }),
    el("td", { class: "wide", "data-testid": "changed", text: v.changed_streams.join(", ") }),
    el("td", {}, diffOf(v, versions[i + 1])),
    el("td", { "data-testid": "actor", text: v.actor }),
    el("td", {}, v.current ? el("span", { class: "current", text: "current" }) :
      writeButton(readOnly, { "data-testid": "rollback", onclick: () =>
        change("Roll " + id + " back to " + v.version + "?", statePath(id) + "/rollback",
          { method: "POST", body: JSON.stringify({ version: v.version }) }, id) }, "Roll back"))));
  return el("section", {}, el("h2", { text: "History" }),
    cardTable([["Version"], ["Operation"], ["Changed streams", "wide"], ["Before → after"], ["Actor"], [""]], rows, "history"));
}

/** How a past lease ended, in words: "running" while it still runs. */
function endedText(lease) { return lease.ended_by || "running"; }

function leaseHistorySection(leases) {
  const section = el("section", { "data-testid": "lease-history-section" }, el("h2", { text: "Lock history" }));
  if (leases.status === 404 && leases.body && leases.body.type === "urn:statehouse:problem:history-off") {
    section.append(el("p", { "data-testid": "lease-history-off", text: "This gateway keeps no lock history (it runs with --history=false)." }));
    return section;
  }
  if (leases.status !== 200) { section.append(el("p", { text: problemText(leases) })); return section; }
  if (leases.body.leases.length === 0) { section.append(el("p", { text: "No leases yet." })); return section; }
  const rows = leases.body.leases.map((l) => el("tr", { "data-testid": "lease-row", "data-fencing-token": String(l.fencing_token) },
    el("td", { text: l.owner }),
    el("td", { text: String(l.fencing_token) }),
    el("td", {}, infoList(l.info)),
    el("td", { text: l.acquired_at }),
    el("td", { "data-testid": "ended-by", class: l.ended_by === "forced" ? "forced" : undefined, text: endedText(l) }),
    el("td", { text: l.ended_at || "" }),
    el("td", { "data-testid": "forced-actor", text: l.actor || "" }),
    el("td", { "data-testid": "forced-reason", text: l.reason || "" })));
  section.append(cardTable([["Owner"], ["Fencing token"], ["Info"], ["Acquired"], ["Ended"], ["Ended at"], ["Forced by"], ["Reason"]], rows, "lease-history"));
  return section;
}

/** The state page's hash, as of `at` (a version's time) when given. */
function stateHash(id, at) {
  return "#/state/" + encodeURIComponent(id) + (at ? "?at=" + encodeURIComponent(at) : "");
}

/** The state's page; as of `at` (a version's time), its bookmarks and document are as they stood then. */
export async function renderState(id, at) {
  const route = location.hash;
  const asOf = at ? { at } : {};
  const [state, history, marks, lock, leases, readOnly, runs] = await Promise.all([
    api(statePath(id) + (at ? "?" + new URLSearchParams(asOf) : "")),
    api(statePath(id) + "/history?limit=100&bookmarks=true"),
    api("/v1/bookmarks?" + new URLSearchParams({ pattern: globFor(id), limit: "1000", ...asOf })),
    api("/v1/locks/" + encodeURIComponent(id)),
    api("/v1/locks/" + encodeURIComponent(id) + "/history?limit=20"),
    whyReadOnly(),
    api("/v1/runs?" + new URLSearchParams({ pattern: globFor(id), limit: "50" })),
  ]);
  // The glob may match a few ids more: only this one's runs.
  if (runs.status === 200) runs.body.runs = runs.body.runs.filter((r) => r.state_id === id);
  say(state.status === 200 || state.status === 404 ? "" : problemText(state));
  const locks = lockSection(id, lock, readOnly);
  const out = [locks, leaseHistorySection(leases), runsSection(runs)].filter(Boolean);
  if (at) {
    out.unshift(el("p", { "data-testid": "as-of" }, "As of " + at + " ", el("a", { href: stateHash(id), text: "back to now" })));
  }
  if (state.status === 404) {
    locks.append(el("p", { text: "No such state " + (at ? "at " + at : "now") + "; its history may still be below." }));
  }
  const versions = history.status === 200 ? history.body.versions : [];
  const width = Math.max(280, Math.min(view.clientWidth - 40, 1200));
  const charts = bookmarkCharts(versions, width);
  const regressed = new Set(charts.regressions.filter((r) => versions[0] && r.version === versions[0].version).map((r) => r.stream));
  const lost = new Set(versions[0] ? versions[0].lost_streams || [] : []);
  if (marks.status === 200) out.push(bookmarksSection(id, marks, regressed, lost, versions[1], readOnly));
  if (versions.length > 0) out.push(charts.section);
  if (state.status === 200) {
    out.push(el("section", {}, el("h2", { text: at ? "Document as of " + at : "Document" }),
      el("pre", { "data-testid": "document", text: JSON.stringify({ completed: state.body.completed, partial: state.body.partial }, null, 2) })));
  }
  if (history.status === 200) out.push(historySection(id, versions, readOnly));
  else if (history.body && history.body.detail) out.push(el("section", {}, el("h2", { text: "History" }), el("p", { text: history.body.detail })));
  show(route, ...out);
}
