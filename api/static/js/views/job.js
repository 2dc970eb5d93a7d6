// One job: its summary, controls (pause, resume, cancel), live metric charts, events, checkpoints with adapter
// downloads, result files and its spec. Polls every 2 s while the job is not finished; metrics are fetched
// incrementally (after_step).

import { api, download } from "../api.js";
import { LineChart } from "../chart.js";
import {
  announce,
  clear,
  fmtClock,
  fmtCount,
  fmtDuration,
  fmtNum,
  fmtTime,
  focusHeading,
  h,
  jobDuration,
  methodOf,
  now,
  poller,
  statusBadge,
} from "../dom.js";
import { Series, planCharts } from "../metrics.js";
import { PAUSABLE, PAUSED, TERMINAL } from "../status.js";
import { REWARD_MEAN } from "../vocabulary.js";

const POLL_MS = 2000;
const EVENTS_PAGE = 100;
const EVENTS_BACKFILL_PAGES = 3; // older pages read at once when the newest hold few events besides step events

export function mountJob(main, { jobId }) {
  document.title = `${jobId} · Proxima`;
  const base = `/fine_tuning/jobs/${jobId}`;
  let job = null;
  let series = new Series();
  const charts = new Map(); // chart id → {chart, keys}
  let lastCheckpointsKey = null;
  let resultFilesKey = null;
  let showStepEvents = false;
  let events = []; // newest first; the newest page is polled, older pages are read on demand (they never change)
  let olderAfter = null; // the cursor of the next older page, null when there is none
  let eventsLoaded = false;

  // -- skeleton --------------------------------------------------------------------------------------------------
  const badge = h("span", { class: "badge-slot" });
  const actionError = h("p", { class: "error-box", role: "alert", hidden: true });
  const pauseBtn = h("button", { type: "button", class: "btn", text: "Pause" });
  const resumeBtn = h("button", { type: "button", class: "btn", text: "Resume" });
  const cancelBtn = h("button", { type: "button", class: "btn btn-danger", text: "Cancel job" });
  const summary = h("dl", { class: "summary" });
  const jobError = h("div", { class: "error-box", role: "alert", hidden: true });
  const chartGrid = h("div", { class: "chart-grid", id: "charts" });
  const noMetrics = h("p", { class: "empty", text: "No metrics yet: the first point comes after the first training step." });
  const otherGrid = h("div", { class: "chart-grid chart-grid-small" });
  const otherCount = h("span");
  const otherSection = h("details", { class: "other-metrics", open: true, hidden: true }, h("summary", {}, "Other metrics ", otherCount), otherGrid);
  const eventsList = h("ol", { class: "events", "aria-label": "Events, newest first" });
  const stepToggle = h("input", { type: "checkbox", id: "show-step-events" });
  const olderBtn = h("button", { type: "button", class: "btn btn-small", hidden: true, text: "Load older events" });
  const ckptBody = h("tbody");
  const ckptTable = h(
    "table",
    { class: "table checkpoints" },
    h("caption", { class: "visually-hidden", text: "Checkpoints, latest step first" }),
    h("thead", {}, h("tr", {}, h("th", { scope: "col", class: "num", text: "Step" }), h("th", { scope: "col", text: "Created" }), h("th", { scope: "col", class: "num", text: "Reward" }), h("th", { scope: "col", text: "Adapter" }))),
    ckptBody,
  );
  const noCkpt = h("p", { class: "empty", text: "No checkpoints yet." });
  const resultFiles = h("ul", { class: "result-files" });
  const resultSection = h("section", { class: "panel", hidden: true, "aria-labelledby": "results-title" }, h("h2", { id: "results-title", text: "Result files" }), resultFiles);
  const specPre = h("pre", { class: "spec", tabindex: "0" });
  const updated = h("span", { class: "muted updated" });

  const head = h(
    "div",
    { class: "page-head" },
    h(
      "div",
      { class: "title-block" },
      h("nav", { "aria-label": "Breadcrumb", class: "crumbs" }, h("a", { href: "#/jobs", text: "Jobs" }), " / "),
      h("h1", { class: "mono", text: jobId }),
      badge,
    ),
    h(
      "div",
      { class: "head-actions" },
      updated,
      h("a", { class: "btn", href: `#/jobs/${jobId}/rollouts`, text: "Rollouts" }),
      h("a", { class: "btn", href: `#/jobs/${jobId}/playground`, text: "Playground" }),
      h("a", { class: "btn", href: `#/compare?jobs=${jobId}`, text: "Compare" }),
      pauseBtn,
      resumeBtn,
      cancelBtn,
    ),
  );
  main.append(
    head,
    actionError,
    summary,
    jobError,
    h("section", { "aria-labelledby": "metrics-title" }, h("h2", { id: "metrics-title", text: "Metrics" }), noMetrics, chartGrid, otherSection),
    h(
      "div",
      { class: "columns" },
      h(
        "section",
        { class: "panel", "aria-labelledby": "events-title" },
        h("div", { class: "panel-head" }, h("h2", { id: "events-title", text: "Events" }), h("label", { class: "inline" }, stepToggle, " step events")),
        eventsList,
        olderBtn,
      ),
      h(
        "div",
        {},
        h("section", { class: "panel", "aria-labelledby": "ckpt-title" }, h("h2", { id: "ckpt-title", text: "Checkpoints" }), noCkpt, h("div", { class: "table-wrap" }, ckptTable)),
        resultSection,
      ),
    ),
    h("details", { class: "panel spec-panel" }, h("summary", {}, h("h2", { class: "inline-heading", text: "Spec" })), specPre),
  );
  focusHeading(main);

  // -- rendering -------------------------------------------------------------------------------------------------
  function item(label, value, cls, wide = false) {
    return h(
      "div",
      { class: wide ? "summary-item wide" : "summary-item" },
      h("dt", { text: label }),
      h("dd", { class: cls, title: typeof value === "string" ? value : null }, value),
    );
  }

  function renderSummary() {
    badge.replaceChildren(statusBadge(job.status));
    const total = job.total_steps;
    const progress = total
      ? h("span", { class: "progress" }, h("progress", { max: total, value: job.current_step, "aria-label": "Training progress" }), ` ${job.current_step} / ${total}`)
      : String(job.current_step || 0);
    const eta = job.estimated_finish && !TERMINAL.has(job.status) ? `${fmtClock(job.estimated_finish)} (in ${fmtDuration(job.estimated_finish - now())})` : "–";
    summary.replaceChildren(
      item("Method", methodOf(job)),
      item("Base model", job.model, "truncate"),
      item("Step", progress),
      item("Created", fmtTime(job.created_at)),
      item(TERMINAL.has(job.status) ? "Duration" : "Running for", fmtDuration(jobDuration(job))),
      item("Estimated finish", eta),
      item("Trained tokens", fmtCount(job.trained_tokens)),
      item("Suffix", job.suffix ?? "–"),
      item("Fine-tuned model", job.fine_tuned_model ?? "–", "mono", true),
    );
    if (job.error) {
      jobError.replaceChildren(h("strong", { text: `Failed (${job.error.code}): ` }), job.error.message);
      jobError.hidden = false;
    } else {
      jobError.hidden = true;
    }
    cancelBtn.disabled = TERMINAL.has(job.status);
    pauseBtn.disabled = !PAUSABLE.has(job.status);
    resumeBtn.disabled = job.status !== PAUSED;
    specPre.textContent = JSON.stringify(
      {
        model: job.model,
        training_file: job.training_file,
        validation_file: job.validation_file,
        seed: job.seed,
        suffix: job.suffix,
        metadata: job.metadata,
        method: job.method,
      },
      null,
      2,
    );
    document.title = `${job.status} · ${jobId} · Proxima`;
  }

  function renderCharts() {
    const { preferred, other } = planCharts(series.names());
    const wanted = new Map();
    const place = (grid, specs, height) => {
      const els = specs.map((spec) => {
        const keys = spec.series.map((s) => `${s.key}|${s.band ?? ""}`).join(",");
        let entry = charts.get(spec.id);
        if (!entry || entry.keys !== keys) {
          entry?.chart.destroy();
          entry = { chart: new LineChart({ ...spec, sync: `job-${jobId}`, height }), keys };
          charts.set(spec.id, entry);
        }
        wanted.set(spec.id, entry);
        return entry.chart.el;
      });
      const same = els.length === grid.children.length && els.every((el, i) => grid.children[i] === el);
      if (!same) grid.replaceChildren(...els);
    };
    place(chartGrid, preferred, 170);
    place(otherGrid, other, 130);
    for (const [id, entry] of charts) {
      if (!wanted.has(id)) {
        entry.chart.destroy();
        charts.delete(id);
      }
    }
    for (const { chart } of charts.values()) chart.setData(series.steps, (key) => series.col(key));
    noMetrics.hidden = series.length > 0;
    otherSection.hidden = other.length === 0;
    otherCount.textContent = `(${other.length})`;
    chartGrid.dataset.steps = String(series.length);
  }

  function renderEvents() {
    const shown = events.filter((e) => showStepEvents || e.type !== "metrics");
    eventsList.replaceChildren(
      ...shown.map((e) =>
        h(
          "li",
          { class: `event event-${e.level}` },
          h("time", { datetime: new Date(e.created_at * 1000).toISOString(), text: fmtTime(e.created_at) }),
          h("span", { class: `level level-${e.level}`, text: e.level }),
          h("span", { class: "message", text: e.message }),
        ),
      ),
    );
    if (!shown.length) eventsList.append(h("li", { class: "empty", text: "No events." }));
    olderBtn.hidden = olderAfter === null;
  }

  function renderCheckpoints(items) {
    ckptBody.replaceChildren(
      ...items.map((c) => {
        const button = h("button", { type: "button", class: "btn btn-small", text: "Download", "aria-label": `Download the adapter of step ${c.step_number}` });
        button.addEventListener("click", () => downloading(button, `${base}/checkpoints/${c.id}/adapter`, `${jobId}-step-${c.step_number}-adapter.tar.gz`));
        const reward = c.metrics[REWARD_MEAN];
        return h(
          "tr",
          { dataset: { checkpoint: c.id } },
          h("td", { class: "num", text: String(c.step_number) }),
          h("td", { class: "nowrap", text: fmtTime(c.created_at) }),
          h("td", { class: "num", text: reward === undefined ? "–" : fmtNum(reward) }),
          h("td", {}, button),
        );
      }),
    );
    ckptTable.hidden = items.length === 0;
    noCkpt.hidden = items.length !== 0;
  }

  async function renderResultFiles() {
    const files = await Promise.all(job.result_files.map((id) => api(`/files/${id}`).catch(() => ({ id, filename: id, bytes: null }))));
    resultFiles.replaceChildren(
      ...files.map((f) => {
        const button = h("button", { type: "button", class: "btn btn-small", text: "Download", "aria-label": `Download ${f.filename}` });
        button.addEventListener("click", () => downloading(button, `/files/${f.id}/content`, f.filename));
        return h("li", {}, h("span", { class: "mono", text: f.filename }), h("span", { class: "muted", text: f.bytes === null ? "" : ` ${fmtCount(f.bytes)} bytes ` }), button);
      }),
    );
    resultSection.hidden = files.length === 0;
  }

  /** Put the newest page in front of what is shown; a page that shares no event with it starts over. */
  async function mergeEvents(page) {
    const known = new Set(events.map((e) => e.id));
    const fresh = page.data.filter((e) => !known.has(e.id));
    if (eventsLoaded && fresh.length === 0) return;
    if (!eventsLoaded || fresh.length === page.data.length) {
      events = page.data;
      olderAfter = page.has_more ? page.data.at(-1).id : null;
    } else {
      events = [...fresh, ...events];
    }
    eventsLoaded = true;
    for (let i = 0; i < EVENTS_BACKFILL_PAGES && olderAfter && events.filter((e) => e.type !== "metrics").length < 10; i++) {
      await loadOlder();
    }
    renderEvents();
  }

  async function loadOlder() {
    const page = await api(`${base}/events?limit=${EVENTS_PAGE * 2}&after=${encodeURIComponent(olderAfter)}`);
    events = [...events, ...page.data];
    olderAfter = page.has_more && page.data.length ? page.data.at(-1).id : null;
  }

  async function downloading(button, path, name) {
    const label = button.textContent;
    button.disabled = true;
    button.textContent = "Downloading…";
    actionError.hidden = true;
    try {
      const saved = await download(path, name);
      announce(`Downloaded ${saved}`);
    } catch (err) {
      actionError.textContent = `Download failed: ${err.message}`;
      actionError.hidden = false;
    } finally {
      button.disabled = false;
      button.textContent = label;
    }
  }

  // -- polling ---------------------------------------------------------------------------------------------------
  async function tick() {
    try {
      job = await api(base);
    } catch (err) {
      if (err.status === 404) {
        clear(main).append(
          h("h1", { text: "Job not found" }),
          h("p", { class: "error-box", role: "alert", text: err.message }),
          h("p", {}, h("a", { href: "#/jobs", text: "Back to the jobs" })),
        );
        focusHeading(main);
        return false;
      }
      throw err;
    }
    renderSummary();
    if (series.lastStep !== null && job.current_step < series.lastStep) series = new Series(); // resumed from an earlier checkpoint
    const after = series.lastStep === null ? "" : `?after_step=${series.lastStep}`;
    const [points, evPage, ckPage] = await Promise.all([
      api(`${base}/metrics${after}`),
      api(`${base}/events?limit=${EVENTS_PAGE}`),
      api(`${base}/checkpoints?limit=100`),
    ]);
    if (points.data.length || charts.size === 0) {
      series.append(points.data);
      renderCharts();
    }
    await mergeEvents(evPage);
    const ckKey = ckPage.data.map((c) => c.id).join();
    if (ckKey !== lastCheckpointsKey) {
      lastCheckpointsKey = ckKey;
      renderCheckpoints(ckPage.data);
    }
    if (job.result_files.join() !== resultFilesKey) {
      resultFilesKey = job.result_files.join();
      await renderResultFiles();
    }
    updated.textContent = TERMINAL.has(job.status) ? "" : `Live · ${new Date().toLocaleTimeString()}`;
    return !TERMINAL.has(job.status);
  }

  const poll = poller(tick, POLL_MS);

  async function act(action, done) {
    actionError.hidden = true;
    for (const b of [pauseBtn, resumeBtn, cancelBtn]) b.disabled = true;
    try {
      job = await api(`${base}/${action}`, { method: "POST" });
      renderSummary();
      announce(done);
    } catch (err) {
      actionError.textContent = `${action} failed: ${err.message}`;
      actionError.hidden = false;
    }
    poll.now();
  }

  pauseBtn.addEventListener("click", () => act("pause", "Pause requested: the job pauses at its next checkpoint."));
  resumeBtn.addEventListener("click", () => act("resume", "Job resumed."));
  cancelBtn.addEventListener("click", () => {
    if (window.confirm(`Cancel ${jobId}? A running job stops within one training step.`)) act("cancel", "Cancellation requested.");
  });
  olderBtn.addEventListener("click", async () => {
    olderBtn.disabled = true;
    try {
      await loadOlder();
      renderEvents();
    } finally {
      olderBtn.disabled = false;
    }
  });
  stepToggle.addEventListener("change", () => {
    showStepEvents = stepToggle.checked;
    renderEvents();
  });

  return () => {
    poll.stop();
    for (const { chart } of charts.values()) chart.destroy();
  };
}
