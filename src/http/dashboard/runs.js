// A state's runs on its page (issue 54): each run's status, start, duration,
// exit and the streams it moved, failed and lost runs marked in words and
// colour, and a bar per run for its duration, newest first.

import { cardTable, el, problemText } from "./common.js";

/** How a run ended, in words; `lost` says why. */
function statusText(run) {
  if (run.status === "lost") return "lost (its lease ended first)";
  return run.status;
}

function exitText(run) {
  if (run.exit_code !== null) return String(run.exit_code);
  if (run.signal !== null) return "signal " + run.signal;
  return "";
}

function durationText(run) {
  return run.duration_seconds === null ? "running" : run.duration_seconds.toFixed(1) + " s";
}

/** One bar per ended run, its length its duration against the longest. */
function durationBars(runs) {
  const ended = runs.filter((r) => r.duration_seconds !== null);
  const longest = Math.max(...ended.map((r) => r.duration_seconds), 0.001);
  const bars = ended.map((r) => {
    const bar = el("span", { class: "bar " + (r.status === "succeeded" ? "" : "bad") });
    bar.style.width = Math.max(1, Math.round((r.duration_seconds / longest) * 100)) + "%";
    return el("li", { "data-testid": "run-bar", title: r.started_at + ": " + durationText(r) },
      el("span", { class: "bar-label", text: r.started_at.slice(0, 16).replace("T", " ") }), bar,
      el("span", { class: "bar-value", text: durationText(r) }));
  });
  return el("ol", { class: "bars", "data-testid": "run-durations" }, ...bars);
}

export function runsSection(runs) {
  const section = el("section", { "data-testid": "runs-section" }, el("h2", { text: "Runs" }));
  if (runs.status === 404) return null;
  if (runs.status !== 200) { section.append(el("p", { text: problemText(runs) })); return section; }
  const list = runs.body.runs;
  if (list.length === 0) { section.append(el("p", { text: "No runs recorded yet." })); return section; }
  const rows = list.map((r) => el("tr", { "data-testid": "run-row", "data-status": r.status },
    el("td", { "data-testid": "run-status", class: r.status === "failed" || r.status === "lost" ? "failed" : undefined, text: statusText(r) }),
    el("td", { text: r.started_at }),
    el("td", { text: durationText(r) }),
    el("td", { "data-testid": "run-exit", text: exitText(r) }),
    el("td", { text: r.advanced.map((a) => a.stream).join(", ") })));
  section.append(durationBars(list),
    cardTable([["Status"], ["Started"], ["Duration"], ["Exit"], ["Streams advanced", "wide"]], rows, "runs"));
  return section;
}
