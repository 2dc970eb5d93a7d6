// Tinker training sessions, read from /v1/training_sessions: the tenant's sessions, newest first, and one
// session's numbers, saved states (their tinker:// paths), recent requests and the loss of its forward_backward
// requests. Both views poll while shown; a closed session's page stops, as it cannot change any more.

import { api } from "../api.js";
import { LineChart } from "../chart.js";
import { clear, fmtCount, fmtDuration, fmtNum, fmtTime, focusHeading, h, poller } from "../dom.js";

const POLL_MS = 3000;
const PAGE = 20; // rows added by "Load more"
const MAX_LIMIT = 100; // the list endpoint's largest page: more than that is read page by page with `after`
const FORWARD_BACKWARD = "forward_backward";

// Job badges' colours: a session held by a worker looks running, an unloaded one queued, a closed one cancelled.
const SESSION_BADGE = { loaded: "badge-running", unloaded: "badge-queued", closed: "badge-cancelled" };
const REQUEST_BADGE = { pending: "badge-queued", running: "badge-running", done: "badge-succeeded", failed: "badge-failed" };

const badge = (classes, status) => h("span", { class: `badge ${classes[status] ?? ""}`, text: status });
const sessionHref = (id) => `#/sessions/${id}`;
const orDash = (v) => (v === null || v === undefined ? "–" : String(v));
// A request's duration: most take under a second, where milliseconds say more than fmtDuration's whole seconds.
const fmtSeconds = (s) => (s < 1 ? `${Math.round(s * 1000)} ms` : s < 60 ? `${s.toFixed(1)}s` : fmtDuration(s));

function fmtBytes(n) {
  if (n < 1024) return `${n} B`;
  const units = ["KiB", "MiB", "GiB", "TiB"];
  let v = n / 1024;
  let i = 0;
  for (; v >= 1024 && i < units.length - 1; i++) v /= 1024;
  return `${fmtNum(v)} ${units[i]}`;
}

/** The newest `count` sessions, read with `after` past the endpoint's largest page, and whether older ones exist. */
async function newestSessions(count) {
  const sessions = [];
  let after = null;
  for (;;) {
    const limit = Math.min(count - sessions.length, MAX_LIMIT);
    const page = await api(`/training_sessions?limit=${limit}${after ? `&after=${encodeURIComponent(after)}` : ""}`);
    sessions.push(...page.data);
    if (!page.has_more || sessions.length >= count || page.data.length === 0) return { sessions, hasMore: page.has_more };
    after = page.data.at(-1).id;
  }
}

// -- the list --------------------------------------------------------------------------------------------------

export function mountSessions(main) {
  document.title = "Sessions · Proxima";
  let wanted = PAGE;

  const updated = h("span", { class: "muted updated", "aria-live": "off" });
  const errorBox = h("p", { class: "error-box", role: "alert", hidden: true });
  const tbody = h("tbody");
  const empty = h("p", { class: "empty", hidden: true, text: "No training sessions yet: the Tinker SDK's create_lora_training_client makes them." });
  const more = h("button", { type: "button", class: "btn", hidden: true, text: "Load more" });
  const columns = ["Session", "Status", "Base model", "LoRA rank", "Requests", "Steps", "Last loss", "Restores", "Saved states", "Last request"];
  const numeric = new Set(["LoRA rank", "Requests", "Steps", "Last loss", "Restores", "Saved states"]);
  const table = h(
    "table",
    { class: "table sessions-table" },
    h("caption", { class: "visually-hidden", text: "Training sessions, newest first" }),
    h("thead", {}, h("tr", {}, columns.map((t) => h("th", { scope: "col", text: t, class: numeric.has(t) ? "num" : null })))),
    tbody,
  );

  main.append(
    h("div", { class: "page-head" }, h("h1", { text: "Training sessions" }), h("div", { class: "head-actions" }, updated)),
    errorBox,
    h("div", { class: "table-wrap" }, table),
    empty,
    more,
  );
  focusHeading(main);

  const rows = new Map(); // session id → {tr, cells}: updated in place, so that a focused link keeps its focus

  function row(s) {
    let r = rows.get(s.id);
    if (!r) {
      const td = (cls) => h("td", { class: cls });
      const cells = [td("nowrap"), td(), td("truncate"), td("num"), td("num"), td("num"), td("num"), td("num"), td("num"), td("nowrap")];
      cells[0].append(h("a", { href: sessionHref(s.id), class: "mono", text: s.id }));
      r = { tr: h("tr", { dataset: { sessionId: s.id } }, cells), cells, status: null };
      rows.set(s.id, r);
    }
    const [, status, model, rank, requests, steps, loss, restores, states, last] = r.cells;
    if (r.status !== s.status) {
      status.replaceChildren(badge(SESSION_BADGE, s.status));
      r.status = s.status;
    }
    model.textContent = s.base_model;
    model.title = s.base_model;
    rank.textContent = orDash(s.lora_rank);
    requests.textContent = fmtCount(s.request_count);
    steps.textContent = fmtCount(s.optimizer_steps);
    loss.textContent = fmtNum(s.last_loss);
    restores.textContent = fmtCount(s.restores);
    states.textContent = fmtCount(s.saved_states.length);
    last.textContent = fmtTime(s.last_request_at);
    return r.tr;
  }

  async function refresh() {
    try {
      const { sessions, hasMore } = await newestSessions(wanted);
      const trs = sessions.map(row);
      if (!(trs.length === tbody.children.length && trs.every((tr, i) => tbody.children[i] === tr))) tbody.replaceChildren(...trs);
      table.hidden = sessions.length === 0;
      empty.hidden = sessions.length !== 0;
      more.hidden = !hasMore;
      errorBox.hidden = true;
      updated.textContent = `Updated ${new Date().toLocaleTimeString()}`;
    } catch (err) {
      errorBox.textContent = `Could not load the sessions: ${err.message}`;
      errorBox.hidden = false;
    }
  }

  const poll = poller(refresh, POLL_MS);
  more.addEventListener("click", () => {
    wanted += PAGE;
    poll.now();
  });
  return () => poll.stop();
}

// -- one session -----------------------------------------------------------------------------------------------

export function mountSession(main, { sessionId }) {
  document.title = `${sessionId} · Proxima`;
  let statesKey = null;
  let requestsKey = null;

  const badgeSlot = h("span", { class: "badge-slot" });
  const summary = h("dl", { class: "summary" });
  const updated = h("span", { class: "muted updated" });
  const lossChart = new LineChart({ id: "loss", title: "Loss of forward_backward requests, oldest first", series: [{ key: "loss", label: "loss" }] });
  const lossGrid = h("div", { class: "chart-grid" }, lossChart.el);
  const noLoss = h("p", { class: "empty", text: "No forward_backward loss among the recent requests." });
  const statesBody = h("tbody");
  const statesTable = h(
    "table",
    { class: "table saved-states" },
    h("caption", { class: "visually-hidden", text: "Saved states, oldest first" }),
    h("thead", {}, h("tr", {}, ["Path", "Kind", "Steps", "Size", "Created", "Expires"].map((t) => h("th", { scope: "col", text: t, class: t === "Steps" || t === "Size" ? "num" : null })))),
    statesBody,
  );
  const noStates = h("p", { class: "empty", text: "No saved states." });
  const requestsBody = h("tbody");
  const requestsTable = h(
    "table",
    { class: "table session-requests" },
    h("caption", { class: "visually-hidden", text: "Recent requests, newest first" }),
    h("thead", {}, h("tr", {}, ["Kind", "Status", "Loss", "Error", "Created", "Duration"].map((t) => h("th", { scope: "col", text: t, class: t === "Loss" ? "num" : null })))),
    requestsBody,
  );
  const noRequests = h("p", { class: "empty", text: "No requests yet." });

  main.append(
    h(
      "div",
      { class: "page-head" },
      h(
        "div",
        { class: "title-block" },
        h("nav", { "aria-label": "Breadcrumb", class: "crumbs" }, h("a", { href: "#/sessions", text: "Sessions" }), " / "),
        h("h1", { class: "mono", text: sessionId }),
        badgeSlot,
      ),
      h("div", { class: "head-actions" }, updated),
    ),
    summary,
    h("section", { "aria-labelledby": "loss-title" }, h("h2", { id: "loss-title", text: "Loss" }), noLoss, lossGrid),
    h("section", { class: "panel", "aria-labelledby": "states-title" }, h("h2", { id: "states-title", text: "Saved states" }), noStates, h("div", { class: "table-wrap" }, statesTable)),
    h("section", { class: "panel", "aria-labelledby": "requests-title" }, h("h2", { id: "requests-title", text: "Recent requests" }), noRequests, h("div", { class: "table-wrap" }, requestsTable)),
  );
  focusHeading(main);

  function item(label, value, cls) {
    return h("div", { class: "summary-item" }, h("dt", { text: label }), h("dd", { class: cls, title: value }, value));
  }

  function renderSummary(s) {
    badgeSlot.replaceChildren(badge(SESSION_BADGE, s.status));
    summary.replaceChildren(
      item("Base model", s.base_model, "truncate"),
      item("LoRA rank", orDash(s.lora_rank)),
      item("Worker", s.worker ?? "–", "mono"),
      item("Client session", s.client_session_id, "mono"),
      item("Created", fmtTime(s.created_at)),
      item("Last request", fmtTime(s.last_request_at)),
      item("Requests", fmtCount(s.request_count)),
      item("Optimiser steps", fmtCount(s.optimizer_steps)),
      item("Last loss", fmtNum(s.last_loss)),
      item("Restores", fmtCount(s.restores)),
      item("Saved steps", fmtCount(s.saved_steps)),
    );
    document.title = `${s.status} · ${sessionId} · Proxima`;
  }

  function renderStates(states) {
    statesBody.replaceChildren(
      ...states.map((c) =>
        h(
          "tr",
          { dataset: { path: c.path } },
          h("td", { class: "mono", text: c.path }),
          h("td", { text: c.kind }),
          h("td", { class: "num", text: fmtCount(c.optimizer_steps) }),
          h("td", { class: "num nowrap", text: fmtBytes(c.size_bytes) }),
          h("td", { class: "nowrap", text: fmtTime(c.created_at) }),
          h("td", { class: "nowrap", text: c.expires_at === null ? "never" : fmtTime(c.expires_at) }),
        ),
      ),
    );
    statesTable.hidden = states.length === 0;
    noStates.hidden = states.length !== 0;
  }

  function renderRequests(requests) {
    requestsBody.replaceChildren(
      ...requests.map((r) =>
        h(
          "tr",
          { dataset: { requestId: r.id } },
          h("td", { class: "mono", text: r.kind }),
          h("td", {}, badge(REQUEST_BADGE, r.status)),
          h("td", { class: "num", text: fmtNum(r.loss) }),
          h("td", { text: r.error ?? "" }),
          h("td", { class: "nowrap", text: fmtTime(r.created_at) }),
          h("td", { class: "nowrap", text: r.finished_at === null ? "–" : fmtSeconds(r.finished_at - r.created_at) }),
        ),
      ),
    );
    requestsTable.hidden = requests.length === 0;
    noRequests.hidden = requests.length !== 0;
    // The chart's x is the n-th forward_backward with a loss among the recent requests (they come newest first).
    const losses = requests.filter((r) => r.kind === FORWARD_BACKWARD && r.loss !== null).reverse().map((r) => r.loss);
    noLoss.hidden = losses.length > 0;
    lossGrid.hidden = losses.length === 0; // before setData, so that a new chart is drawn at its width
    lossChart.setData(losses.map((_, i) => i + 1), () => losses);
  }

  async function tick() {
    let s;
    try {
      s = await api(`/training_sessions/${encodeURIComponent(sessionId)}`);
    } catch (err) {
      if (err.status === 404) {
        clear(main).append(
          h("h1", { text: "Session not found" }),
          h("p", { class: "error-box", role: "alert", text: err.message }),
          h("p", {}, h("a", { href: "#/sessions", text: "Back to the sessions" })),
        );
        focusHeading(main);
        return false;
      }
      throw err;
    }
    renderSummary(s);
    const sk = JSON.stringify(s.saved_states);
    if (sk !== statesKey) {
      statesKey = sk;
      renderStates(s.saved_states);
    }
    const rk = JSON.stringify(s.recent_requests);
    if (rk !== requestsKey) {
      requestsKey = rk;
      renderRequests(s.recent_requests);
    }
    updated.textContent = s.status === "closed" ? "" : `Live · ${new Date().toLocaleTimeString()}`;
    return s.status !== "closed";
  }

  const poll = poller(tick, POLL_MS);
  return () => {
    poll.stop();
    lossChart.destroy();
  };
}
