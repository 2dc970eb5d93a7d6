// The tenant's evals, read from /v1/evals: the list (name, criteria, data source, created, the latest run's status),
// newest first, and one eval's page: its testing criteria and its runs, newest first, with their result counts and
// each criterion's pass rate. Both poll while a run they show can still change.

import { api } from "../api.js";
import { clear, fmtCount, fmtTime, focusHeading, h, poller } from "../dom.js";
import {
  TERMINAL_RUN,
  describeDataSource,
  evalHref,
  firstItems,
  jsonBlock,
  keyedRows,
  rateCell,
  runBadge,
  runError,
  runHref,
  runModel,
} from "../evals.js";

const LIVE_MS = 2000;
const IDLE_MS = 10000;
const PAGE = 20; // rows added by "Load more"

const NEWEST_FIRST = { order: "desc" };

function head(title, crumbs, ...actions) {
  return h(
    "div",
    { class: "page-head" },
    h("div", { class: "title-block" }, crumbs, title),
    h("div", { class: "head-actions" }, actions),
  );
}

function table(cls, caption, columns, numeric, tbody) {
  return h(
    "table",
    { class: `table ${cls}` },
    h("caption", { class: "visually-hidden", text: caption }),
    h("thead", {}, h("tr", {}, columns.map((t) => h("th", { scope: "col", text: t, class: numeric.has(t) ? "num" : null })))),
    tbody,
  );
}

// -- the list --------------------------------------------------------------------------------------------------

export function mountEvals(main) {
  document.title = "Evals · Proxima";
  let wanted = PAGE;
  const latest = new Map(); // eval id → its newest run, or null when it has none

  const updated = h("span", { class: "muted updated", "aria-live": "off" });
  const errorBox = h("p", { class: "error-box", role: "alert", hidden: true });
  const tbody = h("tbody");
  const empty = h("p", { class: "empty", hidden: true, text: "No evals yet: the API's POST /v1/evals (client.evals.create) makes them." });
  const more = h("button", { type: "button", class: "btn", hidden: true, text: "Load more" });
  const columns = ["Eval", "Criteria", "Data source", "Created", "Latest run"];
  const list = table("evals-table", "Evals, newest first", columns, new Set(["Criteria"]), tbody);
  const drawRows = keyedRows(tbody);

  main.append(head(h("h1", { text: "Evals" }), null, updated), errorBox, h("div", { class: "table-wrap" }, list), empty, more);
  focusHeading(main);

  function latestCell(evalId) {
    const run = latest.get(evalId);
    if (run === undefined) return "…";
    if (run === null) return h("span", { class: "muted", text: "no runs" });
    return [runBadge(run.status), " ", h("a", { href: runHref(evalId, run.id), text: run.name || run.id })];
  }

  function row(e) {
    return h(
      "tr",
      { dataset: { evalId: e.id } },
      h("td", { class: "job-cell" }, h("a", { href: evalHref(e.id), text: e.name || e.id }), e.name ? h("span", { class: "muted suffix mono", text: e.id }) : null),
      h("td", { class: "num", text: fmtCount(e.testing_criteria.length) }),
      h("td", { text: e.data_source_config?.type ?? "–" }),
      h("td", { class: "nowrap", text: fmtTime(e.created_at) }),
      h("td", { class: "nowrap" }, latestCell(e.id)),
    );
  }

  async function fetchLatest(evals) {
    const todo = [...evals];
    const worker = async () => {
      for (let e = todo.shift(); e; e = todo.shift()) {
        try {
          const page = await api(`/evals/${encodeURIComponent(e.id)}/runs?limit=1&order=desc`);
          latest.set(e.id, page.data[0] ?? null);
        } catch {
          // shown as before; retried on the next refresh
        }
      }
    };
    await Promise.all([worker(), worker(), worker(), worker()]);
  }

  let evals = [];
  async function refresh() {
    try {
      const { items, hasMore } = await firstItems("/evals", wanted, NEWEST_FIRST);
      evals = items;
      await fetchLatest(evals);
      drawRows(evals.map((e) => ({ ...e, latest: latest.get(e.id) })), row);
      list.hidden = evals.length === 0;
      empty.hidden = evals.length !== 0;
      more.hidden = !hasMore;
      errorBox.hidden = true;
      updated.textContent = `Updated ${new Date().toLocaleTimeString()}`;
    } catch (err) {
      errorBox.textContent = `Could not load the evals: ${err.message}`;
      errorBox.hidden = false;
    }
  }

  const live = () => evals.some((e) => latest.get(e.id) && !TERMINAL_RUN.has(latest.get(e.id).status));
  const poll = poller(refresh, () => (live() ? LIVE_MS : IDLE_MS));
  more.addEventListener("click", () => {
    wanted += PAGE;
    poll.now();
  });
  return () => poll.stop();
}

// -- one eval --------------------------------------------------------------------------------------------------

/** A criterion's comparison in one line where it has one (string_check), else nothing: the definition is below. */
function criterionRule(c) {
  if (c.type === "string_check") return `${c.input} ${c.operation} ${c.reference}`;
  if (c.type === "text_similarity") return `${c.evaluation_metric}(${c.input}, ${c.reference})`;
  return "";
}

function criteriaRows(criteria) {
  return criteria.map((c) =>
    h(
      "tr",
      { dataset: { criterion: c.name } },
      h("td", { text: c.name }),
      h("td", { class: "mono", text: c.type }),
      h("td", { class: "mono", text: criterionRule(c) }),
      h("td", { class: "num", text: c.pass_threshold === undefined || c.pass_threshold === null ? "–" : String(c.pass_threshold) }),
      h("td", {}, h("details", {}, h("summary", { text: "definition" }), jsonBlock(c))),
    ),
  );
}

function countsCells(counts) {
  const c = counts ?? { passed: 0, failed: 0, errored: 0, total: 0 };
  return [
    h("td", { class: "num", text: fmtCount(c.passed) }),
    h("td", { class: "num", text: fmtCount(c.failed) }),
    h("td", { class: "num", text: fmtCount(c.errored) }),
    h("td", { class: "num", text: fmtCount(c.total) }),
  ];
}

/** The criteria named in the runs' results, in their first run's order (a column each). */
export function criteriaOf(runs) {
  return [...new Set(runs.flatMap((r) => (r.per_testing_criteria_results ?? []).map((p) => p.testing_criteria)))];
}

function runRow(evalId, run, criteria) {
  const byName = new Map((run.per_testing_criteria_results ?? []).map((p) => [p.testing_criteria, p]));
  const error = runError(run);
  return h(
    "tr",
    { dataset: { runId: run.id } },
    h("td", { class: "job-cell" }, h("a", { href: runHref(evalId, run.id), text: run.name || run.id }), run.name ? h("span", { class: "muted suffix mono", text: run.id }) : null),
    h("td", {}, runBadge(run.status), error ? h("div", { class: "run-error", text: error.message }) : null),
    h("td", { class: "truncate", title: runModel(run), text: runModel(run) }),
    h("td", { text: describeDataSource(run.data_source) }),
    countsCells(run.result_counts),
    criteria.map((name) => {
      const p = byName.get(name);
      return h("td", { class: "num", dataset: { criterion: name } }, p ? rateCell(p.passed, p.failed, `${name} pass rate`) : "–");
    }),
    h("td", { class: "nowrap", text: fmtTime(run.created_at) }),
  );
}

export function mountEval(main, { evalId }) {
  document.title = `${evalId} · Proxima`;
  let wanted = PAGE;
  let criteriaKey = null;
  let live = false; // a shown run can still change
  let shownCriteria = null;
  let drawRuns = null;

  const title = h("h1", { text: evalId });
  const idHint = h("span", { class: "muted mono" });
  const updated = h("span", { class: "muted updated" });
  const summary = h("dl", { class: "summary" });
  const criteriaBody = h("tbody");
  const criteriaTable = table("testing-criteria", "Testing criteria", ["Name", "Type", "Rule", "Pass threshold", ""], new Set(["Pass threshold"]), criteriaBody);
  const runsHead = h("thead");
  const runsBody = h("tbody");
  const runsTable = h("table", { class: "table eval-runs" }, h("caption", { class: "visually-hidden", text: "Runs, newest first" }), runsHead, runsBody);
  const noRuns = h("p", { class: "empty", text: "No runs yet: the API's POST /v1/evals/{id}/runs (client.evals.runs.create) starts one." });
  const more = h("button", { type: "button", class: "btn", hidden: true, text: "Load more runs" });
  const errorBox = h("p", { class: "error-box", role: "alert", hidden: true });

  const crumbs = h("nav", { "aria-label": "Breadcrumb", class: "crumbs" }, h("a", { href: "#/evals", text: "Evals" }), " / ");
  main.append(
    head([title, idHint], crumbs, updated),
    errorBox,
    summary,
    h("section", { class: "panel", "aria-labelledby": "criteria-title" }, h("h2", { id: "criteria-title", text: "Testing criteria" }), h("div", { class: "table-wrap" }, criteriaTable)),
    h("section", { class: "panel", "aria-labelledby": "runs-title" }, h("h2", { id: "runs-title", text: "Runs" }), noRuns, h("div", { class: "table-wrap" }, runsTable), more),
  );
  focusHeading(main);

  function item(label, value) {
    return h("div", { class: "summary-item" }, h("dt", { text: label }), h("dd", { title: value }, value));
  }

  function renderEval(e) {
    title.textContent = e.name || e.id;
    idHint.textContent = e.name ? e.id : "";
    document.title = `${e.name || e.id} · Evals · Proxima`;
    const meta = Object.entries(e.metadata ?? {}).map(([k, v]) => `${k}=${v}`).join(", ");
    summary.replaceChildren(
      item("Data source", e.data_source_config?.type ?? "–"),
      item("Created", fmtTime(e.created_at)),
      item("Criteria", fmtCount(e.testing_criteria.length)),
      item("Metadata", meta || "–"),
    );
    const key = JSON.stringify(e.testing_criteria);
    if (key !== criteriaKey) {
      criteriaKey = key;
      criteriaBody.replaceChildren(...criteriaRows(e.testing_criteria));
    }
  }

  function renderRuns(runs, hasMore) {
    const criteria = criteriaOf(runs);
    const counts = ["Passed", "Failed", "Errored", "Total"];
    runsHead.replaceChildren(
      h(
        "tr",
        {},
        ["Run", "Status", "Model", "Data source"].map((t) => h("th", { scope: "col", text: t })),
        counts.map((t) => h("th", { scope: "col", class: "num", text: t })),
        criteria.map((name) => h("th", { scope: "col", class: "num", text: name, title: `pass rate of ${name}` })),
        h("th", { scope: "col", text: "Created" }),
      ),
    );
    const columnsKey = criteria.join("\n");
    if (columnsKey !== shownCriteria) {
      shownCriteria = columnsKey; // other columns: every row is redrawn
      drawRuns = keyedRows(runsBody);
    }
    drawRuns(runs, (r) => runRow(evalId, r, criteria));
    runsTable.hidden = runs.length === 0;
    noRuns.hidden = runs.length !== 0;
    more.hidden = !hasMore;
  }

  async function tick() {
    let e;
    try {
      e = await api(`/evals/${encodeURIComponent(evalId)}`);
    } catch (err) {
      if (err.status === 404) {
        clear(main).append(
          h("h1", { text: "Eval not found" }),
          h("p", { class: "error-box", role: "alert", text: err.message }),
          h("p", {}, h("a", { href: "#/evals", text: "Back to the evals" })),
        );
        focusHeading(main);
        return false;
      }
      throw err;
    }
    renderEval(e);
    try {
      const { items, hasMore } = await firstItems(`/evals/${encodeURIComponent(evalId)}/runs`, wanted, NEWEST_FIRST);
      renderRuns(items, hasMore);
      errorBox.hidden = true;
      live = items.some((r) => !TERMINAL_RUN.has(r.status));
      updated.textContent = live ? `Live · ${new Date().toLocaleTimeString()}` : "";
    } catch (err) {
      errorBox.textContent = `Could not load the runs: ${err.message}`;
      errorBox.hidden = false;
    }
    return true;
  }

  // Idle evals are polled too, slowly: a new run can start at any time.
  const poll = poller(tick, () => (live ? LIVE_MS : IDLE_MS));
  more.addEventListener("click", () => {
    wanted += PAGE;
    poll.now();
  });
  return () => poll.stop();
}
