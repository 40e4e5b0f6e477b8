// Each stream's bookmark over a state's history versions, drawn by uPlot
// (vendor/uPlot.iife.min.js, loaded before the modules): one chart per kind
// of value, since instants and numbers share no axis. One series per
// stream, one point per version that has the stream; versions that moved a
// stream backwards are marked in red, and say so on hover. A table of the
// same points is the text alternative.

import { cardTable, el, stored } from "./common.js";

/** Saturated, and told apart without red, which marks regressions. */
const COLOURS = ["#1f6fd1", "#e07000", "#1a9a3a", "#8a3ccf", "#c2187a", "#0096a8", "#7a6a00", "#4b4bd8"];
const REGRESSION = "#d7191c";
const ISO_DATE = /^\d{4}-\d{2}-\d{2}/;

/** How a value is charted: "time" (RFC 3339 text), "number", or null (not charted). */
function kindOf(value) {
  if (typeof value === "number") return "number";
  if (typeof value === "string" && ISO_DATE.test(value) && !Number.isNaN(Date.parse(value))) return "time";
  return null;
}

function plotted(value, kind) { return kind === "time" ? Date.parse(value) / 1000 : value; }

/**
 * Sorts the streams of `versions` (newest first, with `bookmarks`) by the
 * kind of their values: a stream is charted when every value it has is of
 * one kind.
 */
function streamsByKind(versions) {
  const kinds = new Map();
  for (const v of versions) {
    for (const [stream, value] of Object.entries(v.bookmarks || {})) {
      const kind = value === null ? null : kindOf(value);
      const seen = kinds.get(stream);
      kinds.set(stream, seen === undefined || seen === kind ? kind : null);
    }
  }
  const byKind = { time: [], number: [], none: [] };
  for (const [stream, kind] of [...kinds].sort()) byKind[kind || "none"].push(stream);
  return byKind;
}

/** An instant on two lines (the date, then hh:mm UTC), to leave a phone's chart room to plot. */
function axisLabel(kind) {
  return kind === "time"
    ? (_u, values) => values.map((v) => new Date(v * 1000).toISOString().slice(0, 16).replace("T", "\n"))
    : (_u, values) => values.map((v) => String(v));
}

/**
 * uPlot's time axis in UTC and 24-hour ISO dates, as the page shows every
 * other time: by default it draws the browser's local time, in US 12-hour
 * stamps ("{M}/{D}/{YY}", "{h}:{mm}{aa}").
 */
const UTC_DATES = {
  tzDate: (ts) => uPlot.tzDate(new Date(Math.round(ts * 1000)), "Etc/UTC"),
  fmtDate: (template) => uPlot.fmtDate(template
    .replaceAll("{M}/{D}/{YY}", "{YYYY}-{MM}-{DD}")
    .replaceAll("{M}/{D}", "{MM}-{DD}")
    .replaceAll("{h}{aa}", "{HH}:00")
    .replaceAll("{h}", "{HH}")
    .replaceAll("{aa}", "")),
};

/** A version as the page writes it elsewhere: ISO 8601 UTC. */
function versionText(_u, ts) { return ts === null ? "" : new Date(Math.round(ts * 1000)).toISOString(); }

/** A point's value in the legend, as an instant or a number. */
function legendValue(kind) {
  return (_u, v) => v === null ? "" : (kind === "time" ? new Date(v * 1000).toISOString() : String(v));
}

/** One chart of `streams`, all of `kind`, over the versions oldest first. */
function chartOf(kind, streams, versions, width) {
  const times = versions.map((v) => Date.parse(v.version) / 1000);
  const series = streams.map((stream) => versions.map((v) => {
    const value = (v.bookmarks || {})[stream];
    return value === undefined || value === null ? null : plotted(value, kind);
  }));
  const marks = versions.map((v, i) => {
    const hit = streams.find((s) => v.regressed_streams.includes(s) && series[streams.indexOf(s)][i] !== null);
    return hit === undefined ? null : series[streams.indexOf(hit)][i];
  });
  const regressions = [];
  versions.forEach((v, i) => {
    for (const stream of streams) {
      if (!v.regressed_streams.includes(stream) || i === 0) continue;
      const before = (versions[i - 1].bookmarks || {})[stream];
      regressions.push({ stream, version: v.version, from: before, to: (v.bookmarks || {})[stream], actor: v.actor });
    }
  });
  const caption = el("p", { class: "chart-caption", "aria-live": "polite", "data-testid": "chart-caption" });
  const box = el("div", {
    class: "chart", "data-testid": "chart", "data-kind": kind,
    "data-series": String(streams.length),
    "data-points": String(series.reduce((n, s) => n + s.filter((p) => p !== null).length, 0)),
    "data-regressions": String(regressions.length),
  }, el("h3", { text: kind === "time" ? "Bookmarks that are instants" : "Bookmarks that are numbers" }));
  const opts = {
    ...UTC_DATES,
    width, height: 240,
    scales: { x: { time: true } },
    // The first tick of the time axis names its date and hh:mm below it:
    // the right padding keeps that label whole when the tick is at the edge.
    padding: [null, 48, null, null],
    axes: [{ label: "version (UTC)", space: 70 },
      kind === "time" ? { values: axisLabel(kind), size: 90, space: 36 } : { values: axisLabel(kind), size: 60 }],
    series: [
      { label: "version", value: versionText },
      ...streams.map((stream, i) => ({
        label: stream, stroke: COLOURS[i % COLOURS.length], width: 3,
        points: { show: true, size: 8, fill: COLOURS[i % COLOURS.length] },
        value: legendValue(kind),
      })),
      { label: "regressed", stroke: REGRESSION, width: 0, paths: () => null, value: legendValue(kind),
        points: { show: true, size: 16, width: 3, stroke: REGRESSION, fill: REGRESSION } },
    ],
    hooks: {
      // The time axis is drawn on the canvas: the labels uPlot drew (its
      // axis's _values) are kept as text too, for a test to read.
      drawAxes: [(u) => { box.dataset.xTicks = u.axes[0]._values.filter((v) => v !== null).join("|"); }],
      setCursor: [(u) => {
        const i = u.cursor.idx;
        const found = i === null || i === undefined ? [] : regressions.filter((r) => r.version === versions[i].version);
        caption.textContent = found.map((r) => r.stream + " regressed at " + r.version + ": " + stored(r.from) + " → " + stored(r.to)).join("; ");
      }],
    },
  };
  const plot = new uPlot(opts, [times, ...series, marks], box);
  box.append(caption);
  return { box, plot, regressions };
}

/** The text alternative: every charted point, a row each. */
function pointsTable(byKind, versions) {
  const rows = [];
  for (const stream of [...byKind.time, ...byKind.number]) {
    versions.forEach((v, i) => {
      const value = (v.bookmarks || {})[stream];
      if (value === undefined || value === null) return;
      const regressed = v.regressed_streams.includes(stream);
      const before = i + 1 < versions.length ? (versions[i + 1].bookmarks || {})[stream] : undefined;
      rows.push(el("tr", { "data-testid": "point-row", tabindex: regressed ? "0" : undefined },
        el("td", { text: stream }), el("td", { text: v.version }), el("td", { text: stored(value) }),
        el("td", { class: regressed ? "regressed" : "", text: regressed ? "regressed from " + stored(before) : "" })));
    });
  }
  return el("details", { class: "points" }, el("summary", { text: "The charted points as a table" }),
    cardTable([["Stream"], ["Version"], ["Value"], [""]], rows, "chart-points"));
}

/**
 * The charts of `versions` (newest first, as the history lists them), with
 * the streams not charted named and the points as a table; answers the
 * section and the regressions found.
 */
export function bookmarkCharts(versions, width) {
  const oldestFirst = [...versions].reverse();
  const byKind = streamsByKind(oldestFirst);
  const section = el("section", { "data-testid": "charts" }, el("h2", { text: "Bookmarks over time" }));
  const regressions = [];
  for (const kind of ["time", "number"]) {
    if (byKind[kind].length === 0) continue;
    const chart = chartOf(kind, byKind[kind], oldestFirst, width);
    regressions.push(...chart.regressions);
    section.append(chart.box);
  }
  if (byKind.none.length > 0) {
    section.append(el("p", { class: "uncharted", "data-testid": "not-charted", text: "Not charted (neither instants nor numbers): " + byKind.none.join(", ") }));
  }
  if (byKind.time.length + byKind.number.length > 0) section.append(pointsTable(byKind, versions));
  return { section, regressions };
}
