// What the Evals pages share: a run's status badge, a pass rate as numbers and a small bar, a run's model and data
// source in a few words, and reading the newest items of a list endpoint page by page with `after`.

import { api } from "./api.js";
import { h } from "./dom.js";
import { CANCELED, COMPLETED, FAILED, IN_PROGRESS, QUEUED, TERMINAL_RUN } from "./eval_status.js";

export { TERMINAL_RUN };

export const MAX_LIMIT = 100; // the list endpoints' largest page: more than that is read page by page with `after`

// A run's statuses (OpenAI's, served from the one definition), drawn with the job badges' colours.
const RUN_BADGE = {
  [QUEUED]: "badge-queued",
  [IN_PROGRESS]: "badge-running",
  [COMPLETED]: "badge-succeeded",
  [FAILED]: "badge-failed",
  [CANCELED]: "badge-cancelled",
};
// An output item passes or fails; one whose sampling or a criterion errored is neither (the API calls it `fail`, the
// run counts it in `errored`), shown as `error`.
const ITEM_BADGE = { pass: "badge-succeeded", fail: "badge-failed", error: "badge-paused" };

export const runBadge = (status) => h("span", { class: `badge ${RUN_BADGE[status] ?? ""}`, text: status.replace("_", " ") });
export const itemBadge = (status) => h("span", { class: `badge ${ITEM_BADGE[status] ?? ""}`, text: status });

/** An output item's status as shown: `error` where its sample or a criterion errored, else the API's pass or fail. */
export const itemStatus = (item) =>
  item.sample?.error?.message || item.results.some((r) => r.errored) ? "error" : item.status;

export const evalHref = (evalId) => `#/evals/${evalId}`;
export const runHref = (evalId, runId) => `#/evals/${evalId}/runs/${runId}`;

/** A run's error, or null: OpenAI's runs carry an `error` object even when nothing failed. */
export const runError = (run) => (run.error && run.error.message ? run.error : null);

/** `passed / (passed + failed)` or null when nothing was graded; errored items count in neither. */
export function passRate(passed, failed) {
  const graded = passed + failed;
  return graded === 0 ? null : passed / graded;
}

export const fmtPct = (rate) => (rate === null ? "–" : `${(rate * 100).toFixed(1)}%`);

/** A pass rate as "66.7%" with a small bar and "2 / 3" under it; `label` names it for screen readers. */
export function rateCell(passed, failed, label) {
  const rate = passRate(passed, failed);
  return h(
    "span",
    { class: "rate", dataset: { passed: String(passed), failed: String(failed) } },
    h("span", { class: "rate-value", text: fmtPct(rate) }),
    h("meter", { class: "rate-bar", min: "0", max: "1", low: "0.5", optimum: "1", value: String(rate ?? 0), "aria-label": label }),
    h("span", { class: "rate-counts muted", text: `${passed} / ${passed + failed}` }),
  );
}

/** A run's data source in a few words: its type and where its items come from. */
export function describeDataSource(ds) {
  if (!ds) return "–";
  const source = ds.source ?? {};
  let from;
  if (source.type === "file_id") from = `file ${source.id}`;
  else if (source.type === "file_content") from = `${source.content?.length ?? 0} inline items`;
  else if (source.type === "stored_completions") from = "stored completions";
  else if (source.type === "responses") from = "responses";
  else from = source.type ?? "";
  return from ? `${ds.type} · ${from}` : ds.type;
}

/** The model a run samples, or "–" for a run that grades samples already in its data. */
export const runModel = (run) => run.model || run.data_source?.model || "–";

/** The first `count` items of a list endpoint in its own order, read past its largest page with `after`, and
 * whether more exist. `query` holds the endpoint's other parameters (order, status). */
export async function firstItems(path, count, query = {}) {
  const items = [];
  let after = null;
  for (;;) {
    const q = new URLSearchParams({ ...query, limit: String(Math.min(count - items.length, MAX_LIMIT)) });
    if (after) q.set("after", after);
    const page = await api(`${path}?${q}`);
    items.push(...page.data);
    if (!page.has_more || items.length >= count || page.data.length === 0) return { items, hasMore: page.has_more };
    after = page.data.at(-1).id;
  }
}

/** A table body whose rows are rebuilt only when their data changed, and reordered only when the order did, so that a
 * focused link keeps its focus across refreshes. `update(items, build)` draws `build(item)` per item, keyed by id. */
export function keyedRows(tbody) {
  const rows = new Map(); // id → {key, tr}
  return (items, build) => {
    const trs = items.map((item) => {
      const key = JSON.stringify(item);
      let r = rows.get(item.id);
      if (!r || r.key !== key) {
        r = { key, tr: build(item) };
        rows.set(item.id, r);
      }
      return r.tr;
    });
    if (!(trs.length === tbody.children.length && trs.every((tr, i) => tbody.children[i] === tr))) tbody.replaceChildren(...trs);
  };
}

/** JSON shown as text, indented. */
export const jsonBlock = (value, cls = "spec") => h("pre", { class: cls, tabindex: "0", text: JSON.stringify(value, null, 2) });
