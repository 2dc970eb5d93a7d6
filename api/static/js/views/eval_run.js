// One eval run, read from /v1/evals/{id}/runs/{run_id}: its status (and error), model, data source, result counts
// and each criterion's pass rate, then its output items as the API pages them (oldest first, "Load more" reads the
// next page with `after`), filtered by pass or fail. Opening an item shows its datasource item, the sample (input
// messages, output) and each criterion's result. The address (`…?status=fail&item=<id>`) can be bookmarked. Polls
// while the run can still change.

import { api } from "../api.js";
import { clear, fmtCount, fmtNum, fmtTime, focusHeading, h, poller } from "../dom.js";
import {
  TERMINAL_RUN,
  describeDataSource,
  evalHref,
  firstItems,
  itemBadge,
  itemStatus,
  jsonBlock,
  keyedRows,
  rateCell,
  runBadge,
  runError,
  runHref,
  runModel,
} from "../evals.js";

const POLL_MS = 2000;
const PAGE = 20; // OpenAI's default page of output items
const FILTERS = { "": "All items", pass: "Passed", fail: "Failed" }; // the endpoint's `status` filter

const text = (v) => (typeof v === "string" ? v : JSON.stringify(v));

function messages(list, emptyText) {
  if (!list?.length) return h("p", { class: "empty", text: emptyText });
  return h(
    "div",
    { class: "messages" },
    list.map((m) => h("div", { class: "msg" }, h("span", { class: "msg-role", text: m.role ?? "" }), h("span", { class: "msg-content", text: text(m.content ?? "") }))),
  );
}

// A criterion that produced no score (its grader failed) neither passes nor fails: its item counts as errored.
const resultBadge = (r) => itemBadge(r.errored ? "error" : r.passed ? "pass" : "fail");
const sampleError = (item) => (item.sample?.error && item.sample.error.message ? item.sample.error : null);

function resultsTable(results) {
  if (!results.length) return h("p", { class: "empty", text: "Not graded: the item has no sample." });
  return h(
    "table",
    { class: "table item-results" },
    h("caption", { class: "visually-hidden", text: "Each criterion's result" }),
    h("thead", {}, h("tr", {}, ["Criterion", "Type", "Score", "Result", "Errors"].map((t) => h("th", { scope: "col", text: t, class: t === "Score" ? "num" : null })))),
    h(
      "tbody",
      {},
      results.map((r) =>
        h(
          "tr",
          { dataset: { criterion: r.name } },
          h("td", { text: r.name }),
          h("td", { class: "mono", text: r.type ?? "–" }),
          h("td", { class: "num", text: fmtNum(r.score) }),
          h("td", {}, resultBadge(r)),
          h("td", { class: "grader-errors", text: (r.errors ?? []).join("\n") }),
        ),
      ),
    ),
  );
}

/** An opened output item: its results first (what a reader looks for), then the sample and the datasource item. */
function itemDetail(item, onClose) {
  const s = item.sample ?? {};
  const error = sampleError(item);
  const usage = s.usage ? `${fmtCount(s.usage.prompt_tokens)} prompt + ${fmtCount(s.usage.completion_tokens)} completion tokens` : null;
  const notes = [s.model, s.finish_reason ? `finish: ${s.finish_reason}` : null, usage].filter(Boolean).join(" · ");
  return h(
    "section",
    { class: "panel output-item", "aria-labelledby": "item-title", dataset: { itemId: item.id } },
    h(
      "div",
      { class: "panel-head" },
      h("h2", { id: "item-title" }, `Item ${item.datasource_item_id} `, itemBadge(itemStatus(item))),
      h("button", { type: "button", class: "btn btn-small", text: "Close", onClick: onClose }),
    ),
    h("p", { class: "muted mono", text: item.id }),
    resultsTable(item.results),
    error ? h("p", { class: "error-box", role: "alert", text: `Sampling failed (${error.code}): ${error.message}` }) : null,
    h("div", { class: "columns" }, h("div", {}, h("h3", { text: "Input" }), messages(s.input, "No input messages.")), h("div", {}, h("h3", { text: "Output" }), messages(s.output, "No output."))),
    notes ? h("p", { class: "muted sample-meta", text: notes }) : null,
    h("h3", { text: "Datasource item" }),
    jsonBlock(item.datasource_item),
  );
}

function outputText(item) {
  const out = item.sample?.output ?? [];
  return out.map((m) => text(m.content ?? "")).join("\n");
}

export function mountEvalRun(main, { evalId, runId, status, itemId }) {
  document.title = `${runId} · Proxima`;
  const base = `/evals/${encodeURIComponent(evalId)}/runs/${encodeURIComponent(runId)}`;
  let filter = Object.hasOwn(FILTERS, status ?? "") ? status : "";
  let wanted = PAGE;
  let opened = null; // the opened item's id
  let run = null;

  const title = h("h1", { text: runId });
  const badgeSlot = h("span", { class: "badge-slot" });
  const updated = h("span", { class: "muted updated" });
  const runErrorBox = h("div", { class: "error-box run-error-box", role: "alert", hidden: true });
  const summary = h("dl", { class: "summary" });
  const criteriaBody = h("tbody");
  const criteriaTable = h(
    "table",
    { class: "table run-criteria" },
    h("caption", { class: "visually-hidden", text: "Each criterion's pass rate" }),
    h("thead", {}, h("tr", {}, ["Criterion", "Passed", "Failed", "Pass rate"].map((t) => h("th", { scope: "col", text: t, class: t === "Criterion" ? null : "num" })))),
    criteriaBody,
  );
  const noCriteria = h("p", { class: "empty", text: "No results yet." });
  const filterSelect = h("select", { id: "item-filter", name: "status" }, Object.entries(FILTERS).map(([value, label]) => h("option", { value, text: label })));
  filterSelect.value = filter;
  const itemsBody = h("tbody");
  const drawItems = keyedRows(itemsBody);
  const itemsTable = h(
    "table",
    { class: "table output-items" },
    h("caption", { class: "visually-hidden", text: "Output items, in the data source's order" }),
    h("thead", {}, h("tr", {}, ["#", "Status", "Results", "Output", ""].map((t) => h("th", { scope: "col", text: t, class: t === "#" ? "num" : null })))),
    itemsBody,
  );
  const noItems = h("p", { class: "empty", hidden: true });
  const more = h("button", { type: "button", class: "btn", hidden: true, text: "Load more" });
  const errorBox = h("p", { class: "error-box", role: "alert", hidden: true });
  const detailSlot = h("div", { class: "item-slot" });

  const evalLink = h("a", { href: evalHref(evalId), text: evalId });
  main.append(
    h(
      "div",
      { class: "page-head" },
      h(
        "div",
        { class: "title-block" },
        h("nav", { "aria-label": "Breadcrumb", class: "crumbs" }, h("a", { href: "#/evals", text: "Evals" }), " / ", evalLink, " / "),
        title,
        badgeSlot,
      ),
      h("div", { class: "head-actions" }, updated),
    ),
    runErrorBox,
    errorBox,
    summary,
    h("section", { class: "panel", "aria-labelledby": "run-criteria-title" }, h("h2", { id: "run-criteria-title", text: "Testing criteria" }), noCriteria, h("div", { class: "table-wrap" }, criteriaTable)),
    detailSlot,
    h(
      "section",
      { class: "panel", "aria-labelledby": "items-title" },
      h("div", { class: "panel-head" }, h("h2", { id: "items-title", text: "Output items" }), h("span", { class: "filter" }, h("label", { for: "item-filter", text: "Show" }), filterSelect)),
      h("div", { class: "table-wrap" }, itemsTable),
      noItems,
      more,
    ),
  );
  focusHeading(main);

  function setAddress() {
    const q = new URLSearchParams();
    if (filter) q.set("status", filter);
    if (opened) q.set("item", opened);
    history.replaceState(null, "", `${runHref(evalId, runId)}${q.size ? `?${q}` : ""}`);
  }

  function item(label, value, cls) {
    return h("div", { class: "summary-item" }, h("dt", { text: label }), h("dd", { class: cls, title: value }, value));
  }

  function renderRun() {
    title.textContent = run.name || run.id;
    document.title = `${run.status} · ${run.name || run.id} · Proxima`;
    badgeSlot.replaceChildren(runBadge(run.status));
    const error = runError(run);
    runErrorBox.hidden = !error;
    if (error) runErrorBox.replaceChildren(h("strong", { text: `Failed (${error.code}): ` }), error.message);
    const c = run.result_counts;
    const usage = run.per_model_usage ?? [];
    const tokens = usage.reduce((sum, u) => sum + u.total_tokens, 0);
    summary.replaceChildren(
      item("Model", runModel(run), "truncate"),
      item("Data source", describeDataSource(run.data_source)),
      item("Created", fmtTime(run.created_at)),
      item("Passed", fmtCount(c.passed)),
      item("Failed", fmtCount(c.failed)),
      item("Errored", fmtCount(c.errored)),
      item("Total", fmtCount(c.total)),
      item("Tokens", usage.length ? fmtCount(tokens) : "–"),
      item("Run id", run.id, "mono"),
    );
    const results = run.per_testing_criteria_results ?? [];
    criteriaBody.replaceChildren(
      ...results.map((p) =>
        h(
          "tr",
          { dataset: { criterion: p.testing_criteria } },
          h("td", { text: p.testing_criteria }),
          h("td", { class: "num", text: fmtCount(p.passed) }),
          h("td", { class: "num", text: fmtCount(p.failed) }),
          h("td", { class: "num" }, rateCell(p.passed, p.failed, `${p.testing_criteria} pass rate`)),
        ),
      ),
    );
    criteriaTable.hidden = results.length === 0;
    noCriteria.hidden = results.length !== 0;
  }

  function itemRow(it) {
    const grades = it.results.map((r) => h("span", { class: `grade ${r.passed ? "pos" : "neg"}`, text: `${r.name} ${r.errored ? "error" : fmtNum(r.score)}` }));
    const error = sampleError(it);
    const open = h("button", { type: "button", class: "btn btn-small", text: "Open", "aria-label": `Open item ${it.datasource_item_id}` });
    open.addEventListener("click", () => show(it));
    return h(
      "tr",
      { dataset: { itemId: it.id } },
      h("td", { class: "num", text: String(it.datasource_item_id) }),
      h("td", {}, itemBadge(itemStatus(it))),
      h("td", {}, h("div", { class: "grades" }, grades)),
      h("td", { class: "item-output" }, error ? h("span", { class: "neg", text: `sampling failed: ${error.message}` }) : h("span", { class: "msg-content", text: outputText(it) })),
      h("td", {}, open),
    );
  }

  function show(it) {
    opened = it.id;
    setAddress();
    detailSlot.replaceChildren(itemDetail(it, close));
    detailSlot.querySelector("h2").tabIndex = -1;
    detailSlot.querySelector("h2").focus();
  }

  function close() {
    opened = null;
    setAddress();
    clear(detailSlot);
  }

  async function loadItems() {
    const query = filter ? { status: filter } : {};
    const { items, hasMore } = await firstItems(`${base}/output_items`, wanted, query);
    drawItems(items, itemRow);
    itemsTable.hidden = items.length === 0;
    noItems.hidden = items.length !== 0;
    noItems.textContent = filter ? `No ${FILTERS[filter].toLowerCase()} items.` : "No output items yet.";
    more.hidden = !hasMore;
  }

  async function tick() {
    try {
      run = await api(base);
    } catch (err) {
      if (err.status === 404) {
        clear(main).append(
          h("h1", { text: "Run not found" }),
          h("p", { class: "error-box", role: "alert", text: err.message }),
          h("p", {}, h("a", { href: evalHref(evalId), text: "Back to the eval" })),
        );
        focusHeading(main);
        return false;
      }
      throw err;
    }
    renderRun();
    try {
      await loadItems();
      errorBox.hidden = true;
    } catch (err) {
      errorBox.textContent = `Could not load the output items: ${err.message}`;
      errorBox.hidden = false;
    }
    const live = !TERMINAL_RUN.has(run.status);
    updated.textContent = live ? `Live · ${new Date().toLocaleTimeString()}` : "";
    return live;
  }

  async function openFromAddress(id) {
    try {
      show(await api(`${base}/output_items/${encodeURIComponent(id)}`));
    } catch (err) {
      if (err.status !== 404) throw err;
      opened = null;
      setAddress();
      detailSlot.replaceChildren(h("p", { class: "error-box", role: "alert", text: `Item ${id}: ${err.message}` }));
    }
  }

  const poll = poller(tick, POLL_MS);
  // The breadcrumb names the eval (read once: only its name could change, and rarely).
  api(`/evals/${encodeURIComponent(evalId)}`)
    .then((e) => {
      if (e.name) evalLink.textContent = e.name;
    })
    .catch(() => {});
  if (itemId) openFromAddress(itemId).catch((err) => console.warn("could not open the item", err));
  filterSelect.addEventListener("change", () => {
    filter = filterSelect.value;
    wanted = PAGE;
    setAddress();
    poll.now();
  });
  more.addEventListener("click", () => {
    wanted += PAGE;
    poll.now();
  });
  return () => poll.stop();
}
