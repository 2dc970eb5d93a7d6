// The jobs table: status, method, base model, created, duration, step, latest reward; filters by status, method
// and text; live refresh; pick jobs to compare.

import { api } from "../api.js";
import {
  clear,
  fmtDuration,
  fmtNum,
  fmtTime,
  focusHeading,
  h,
  jobDuration,
  methodOf,
  poller,
  statusBadge,
} from "../dom.js";
import { STATUSES, TERMINAL, statusLabel } from "../status.js";
import { REWARD_MEAN } from "../vocabulary.js";

const PAGE = 100;
const MAX_JOBS = 1000; // the list endpoint's largest page: refresh what is loaded in one request

export function mountJobs(main, params) {
  document.title = "Jobs · Proxima";
  const state = { jobs: [], hasMore: false, loaded: PAGE, selected: new Set(), error: null };
  const latest = new Map(); // job id → {step, value}: the reward at the job's current step
  const rows = new Map(); // job id → {tr, cells}

  const statusSelect = h(
    "select",
    { id: "filter-status", name: "status" },
    h("option", { value: "", text: "All statuses" }),
    STATUSES.map((s) => h("option", { value: s, text: statusLabel(s) })),
  );
  const methodSelect = h("select", { id: "filter-method", name: "method" }, h("option", { value: "", text: "All methods" }));
  const search = h("input", { id: "filter-text", type: "search", placeholder: "id, model, suffix…", autocomplete: "off" });
  statusSelect.value = params.status ?? "";
  const compareButton = h("button", { type: "button", class: "btn", disabled: true, text: "Compare selected" });
  const updated = h("span", { class: "muted updated", "aria-live": "off" });
  const errorBox = h("p", { class: "error-box", role: "alert", hidden: true });
  const tbody = h("tbody");
  const empty = h("p", { class: "empty", hidden: true });
  const more = h("button", { type: "button", class: "btn", hidden: true, text: "Load more" });
  const allBox = h("input", { type: "checkbox", "aria-label": "Select all shown jobs" });

  const table = h(
    "table",
    { class: "table jobs-table" },
    h("caption", { class: "visually-hidden", text: "Fine-tuning jobs, newest first" }),
    h(
      "thead",
      {},
      h(
        "tr",
        {},
        h("th", { scope: "col", class: "col-check" }, allBox),
        ["Job", "Status", "Method", "Base model", "Created", "Duration", "Step", "Latest reward"].map((t) =>
          h("th", { scope: "col", text: t, class: t === "Latest reward" || t === "Step" ? "num" : null }),
        ),
      ),
    ),
    tbody,
  );

  main.append(
    h(
      "div",
      { class: "page-head" },
      h("h1", { text: "Fine-tuning jobs" }),
      h("div", { class: "head-actions" }, updated, compareButton, h("a", { class: "btn btn-primary", href: "#/new", text: "New job" })),
    ),
    h(
      "div",
      { class: "toolbar", role: "search", "aria-label": "Filter jobs" },
      h("span", { class: "filter" }, h("label", { for: "filter-status", text: "Status" }), statusSelect),
      h("span", { class: "filter" }, h("label", { for: "filter-method", text: "Method" }), methodSelect),
      h("span", { class: "filter" }, h("label", { for: "filter-text", text: "Search" }), search),
    ),
    errorBox,
    h("div", { class: "table-wrap" }, table),
    empty,
    more,
  );
  focusHeading(main);

  function visible() {
    const text = search.value.trim().toLowerCase();
    return state.jobs.filter(
      (j) =>
        (!statusSelect.value || j.status === statusSelect.value) &&
        (!methodSelect.value || methodOf(j) === methodSelect.value) &&
        (!text || [j.id, j.model, j.suffix ?? "", j.fine_tuned_model ?? ""].some((s) => s.toLowerCase().includes(text))),
    );
  }

  function syncMethodOptions() {
    const methods = new Set(state.jobs.map(methodOf));
    if (params.method) methods.add(params.method);
    const want = [...methods].sort();
    const have = [...methodSelect.options].slice(1).map((o) => o.value);
    if (want.join() === have.join()) return;
    const current = methodSelect.value || params.method || "";
    methodSelect.replaceChildren(h("option", { value: "", text: "All methods" }), ...want.map((m) => h("option", { value: m, text: m })));
    methodSelect.value = current;
  }

  function row(job) {
    let r = rows.get(job.id);
    if (!r) {
      const check = h("input", { type: "checkbox", "aria-label": `Select ${job.id} to compare` });
      check.addEventListener("change", () => {
        if (check.checked) state.selected.add(job.id);
        else state.selected.delete(job.id);
        syncSelection();
      });
      // data-label: the column's name, shown in front of the value where the table is laid out as cards.
      const cells = {
        check,
        status: h("td", { "data-label": "Status" }),
        method: h("td", { "data-label": "Method" }),
        model: h("td", { class: "truncate", "data-label": "Model" }),
        created: h("td", { class: "nowrap", "data-label": "Created" }),
        duration: h("td", { class: "nowrap", "data-label": "Duration" }),
        step: h("td", { class: "num nowrap", "data-label": "Step" }),
        reward: h("td", { class: "num", "data-label": "Reward" }),
      };
      const link = h("a", { href: `#/jobs/${job.id}`, class: "mono", text: job.id });
      const tr = h(
        "tr",
        { dataset: { jobId: job.id } },
        h("td", { class: "col-check" }, check),
        h("td", { class: "job-cell" }, link, job.suffix ? h("span", { class: "muted suffix", text: job.suffix }) : null),
        cells.status,
        cells.method,
        cells.model,
        cells.created,
        cells.duration,
        cells.step,
        cells.reward,
      );
      r = { tr, cells, status: null };
      rows.set(job.id, r);
    }
    const c = r.cells;
    if (r.status !== job.status) {
      c.status.replaceChildren(statusBadge(job.status));
      r.status = job.status;
    }
    c.method.textContent = methodOf(job);
    c.model.textContent = job.model;
    c.model.title = job.model;
    c.created.textContent = fmtTime(job.created_at);
    c.duration.textContent = fmtDuration(jobDuration(job));
    c.step.textContent = job.total_steps ? `${job.current_step} / ${job.total_steps}` : String(job.current_step || "–");
    const rew = latest.get(job.id);
    c.reward.textContent = rew ? fmtNum(rew.value) : "–";
    c.check.checked = state.selected.has(job.id);
    return r.tr;
  }

  function render() {
    syncMethodOptions();
    const shown = visible();
    const trs = shown.map(row);
    const same = trs.length === tbody.children.length && trs.every((tr, i) => tbody.children[i] === tr);
    if (!same) tbody.replaceChildren(...trs); // only when the order changed, so focus stays where it is
    table.hidden = shown.length === 0;
    empty.hidden = shown.length !== 0;
    clear(empty);
    if (state.jobs.length === 0) empty.append("No jobs yet. ", h("a", { href: "#/new", text: "Create one" }), ".");
    else empty.append("No jobs match these filters.");
    more.hidden = !state.hasMore;
    allBox.checked = shown.length > 0 && shown.every((j) => state.selected.has(j.id));
    syncSelection();
  }

  function syncSelection() {
    for (const id of state.selected) if (!state.jobs.some((j) => j.id === id)) state.selected.delete(id);
    compareButton.disabled = state.selected.size === 0;
    compareButton.textContent = state.selected.size ? `Compare selected (${state.selected.size})` : "Compare selected";
  }

  async function fetchLatest(jobs) {
    // One small request per job whose step moved since it was last read: the metric at its current step.
    const todo = jobs.filter((j) => j.current_step > 0 && latest.get(j.id)?.step !== j.current_step);
    const worker = async () => {
      for (let job = todo.shift(); job; job = todo.shift()) {
        try {
          const page = await api(`/fine_tuning/jobs/${job.id}/metrics?after_step=${job.current_step - 1}&limit=1`);
          const point = page.data[0];
          const value = point?.metrics[REWARD_MEAN];
          latest.set(job.id, { step: job.current_step, value: typeof value === "number" ? value : null });
        } catch {
          // shown as "–"; retried on the next refresh
        }
      }
    };
    await Promise.all([worker(), worker(), worker(), worker()]);
  }

  async function refresh() {
    try {
      const page = await api(`/fine_tuning/jobs?limit=${Math.min(state.loaded, MAX_JOBS)}`);
      state.jobs = page.data;
      state.hasMore = page.has_more && state.loaded < MAX_JOBS;
      errorBox.hidden = true;
      render();
      updated.textContent = `Updated ${new Date().toLocaleTimeString()}`;
      await fetchLatest(visible());
      render();
    } catch (err) {
      errorBox.textContent = `Could not load jobs: ${err.message}`;
      errorBox.hidden = false;
    }
  }

  const live = () => state.jobs.some((j) => !TERMINAL.has(j.status));
  const poll = poller(refresh, () => (live() ? 2000 : 10000));

  function filtersChanged() {
    const q = new URLSearchParams();
    if (statusSelect.value) q.set("status", statusSelect.value);
    if (methodSelect.value) q.set("method", methodSelect.value);
    params.method = methodSelect.value || null;
    history.replaceState(null, "", `#/jobs${q.size ? `?${q}` : ""}`);
    render();
  }
  statusSelect.addEventListener("change", filtersChanged);
  methodSelect.addEventListener("change", filtersChanged);
  search.addEventListener("input", render);
  allBox.addEventListener("change", () => {
    for (const j of visible()) {
      if (allBox.checked) state.selected.add(j.id);
      else state.selected.delete(j.id);
    }
    render();
  });
  compareButton.addEventListener("click", () => {
    location.hash = `#/compare?jobs=${[...state.selected].join(",")}`;
  });
  more.addEventListener("click", () => {
    state.loaded = Math.min(state.loaded + PAGE, MAX_JOBS);
    poll.now();
  });

  return () => poll.stop();
}
