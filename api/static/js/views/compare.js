// Compare: one metric of several jobs overlaid on one chart, with each job's latest and best value. The selection
// lives in the address (#/compare?jobs=a,b&metric=reward/mean), so a comparison can be bookmarked or shared.

import { api, listAll } from "../api.js";
import { LineChart, PALETTE } from "../chart.js";
import { fmtNum, focusHeading, h, methodOf, poller, shortId, statusBadge } from "../dom.js";
import { Series } from "../metrics.js";
import { TERMINAL } from "../status.js";
import { REWARD_MEAN } from "../vocabulary.js";

const DEFAULT_METRIC = REWARD_MEAN;
const MAX_JOBS_LISTED = 200;

export function mountCompare(main, params) {
  document.title = "Compare · Proxima";
  const selected = [...new Set((params.jobs ?? "").split(","))].filter((id) => /^[\w-]+$/.test(id));
  let metric = params.metric || null;
  let jobs = []; // the tenant's recent jobs
  const series = new Map(); // job id → Series
  let chart = null;
  let chartKey = "";

  const picker = h("fieldset", { class: "job-picker" }, h("legend", { text: "Jobs" }));
  const pickerList = h("div", { class: "picker-list" });
  picker.append(pickerList);
  const metricSelect = h("select", { id: "compare-metric", name: "metric" });
  const chartSlot = h("div", { class: "compare-chart" });
  const hint = h("p", { class: "empty" });
  const errorBox = h("p", { class: "error-box", role: "alert", hidden: true });
  const tbody = h("tbody");
  const table = h(
    "table",
    { class: "table compare-table" },
    h("caption", { class: "visually-hidden", text: "Latest and best value of the metric per job" }),
    h("thead", {}, h("tr", {}, ["", "Job", "Status", "Method", "Steps", "Latest", "Min", "Max"].map((t, i) => h("th", { scope: "col", class: i >= 4 ? "num" : null, text: t })))),
    tbody,
  );

  main.append(
    h("div", { class: "page-head" }, h("h1", { text: "Compare jobs" })),
    errorBox,
    h(
      "div",
      { class: "compare-layout" },
      picker,
      h(
        "div",
        { class: "compare-main" },
        h("div", { class: "toolbar" }, h("label", { for: "compare-metric", text: "Metric" }), metricSelect),
        hint,
        chartSlot,
        h("div", { class: "table-wrap" }, table),
      ),
    ),
  );
  focusHeading(main);

  function label(id) {
    const job = jobs.find((j) => j.id === id);
    return job?.suffix ? `${shortId(id)} (${job.suffix})` : shortId(id);
  }

  function syncAddress() {
    const q = new URLSearchParams();
    if (selected.length) q.set("jobs", selected.join(","));
    if (metric) q.set("metric", metric);
    history.replaceState(null, "", `#/compare${q.size ? `?${q}` : ""}`);
  }

  function renderPicker() {
    const ids = [...new Set([...selected.filter((id) => !missing.has(id)), ...jobs.map((j) => j.id)])];
    pickerList.replaceChildren(
      ...ids.map((id) => {
        const job = jobs.find((j) => j.id === id);
        const box = h("input", { type: "checkbox", id: `pick-${id}`, value: id });
        box.checked = selected.includes(id);
        box.addEventListener("change", () => {
          if (box.checked) selected.push(id);
          else selected.splice(selected.indexOf(id), 1);
          syncAddress();
          poll.now();
        });
        return h(
          "label",
          { class: "pick", for: `pick-${id}` },
          box,
          h("span", { class: "mono", text: shortId(id) }),
          job?.suffix ? h("span", { class: "muted", text: ` ${job.suffix}` }) : null,
          job ? statusBadge(job.status) : null,
        );
      }),
    );
  }

  function renderMetricOptions() {
    const names = new Set();
    for (const id of selected) for (const n of series.get(id)?.names() ?? []) names.add(n);
    const sorted = [...names].sort();
    if (!metric || (!names.has(metric) && names.size)) metric = names.has(DEFAULT_METRIC) ? DEFAULT_METRIC : sorted[0] ?? metric;
    if ([...metricSelect.options].map((o) => o.value).join() !== sorted.join()) {
      metricSelect.replaceChildren(...sorted.map((n) => h("option", { value: n, text: n })));
    }
    if (metric) metricSelect.value = metric;
    metricSelect.disabled = sorted.length === 0;
  }

  function renderChart() {
    const chosen = selected.filter((id) => series.has(id));
    hint.hidden = chosen.length > 0;
    hint.textContent = "Pick one or more jobs to overlay their metric.";
    const key = `${metric}|${chosen.join()}`;
    if (key !== chartKey) {
      chart?.destroy();
      chart = null;
      chartSlot.replaceChildren();
      chartKey = key;
      if (chosen.length && metric) {
        chart = new LineChart({ id: "compare", title: metric, series: chosen.map((id) => ({ key: id, label: label(id) })), height: 320 });
        chartSlot.append(chart.el);
      }
    }
    // The union of the jobs' steps; each job's values aligned with it.
    const steps = [...new Set(chosen.flatMap((id) => series.get(id).steps))].sort((a, b) => a - b);
    const columns = new Map(
      chosen.map((id) => {
        const s = series.get(id);
        const byStep = new Map(s.steps.map((st, i) => [st, s.col(metric)[i]]));
        return [id, steps.map((st) => byStep.get(st) ?? null)];
      }),
    );
    chart?.setData(steps, (id) => columns.get(id));
    tbody.replaceChildren(
      ...chosen.map((id, i) => {
        const job = jobs.find((j) => j.id === id);
        const values = series.get(id).col(metric).filter((v) => v !== null);
        const swatch = h("i", { class: "swatch", "aria-hidden": "true" });
        swatch.style.background = PALETTE[i % PALETTE.length];
        return h(
          "tr",
          {},
          h("td", {}, swatch),
          h("td", {}, h("a", { class: "mono", href: `#/jobs/${id}`, text: id }), job?.suffix ? h("span", { class: "muted", text: ` ${job.suffix}` }) : null),
          h("td", { text: job?.status ?? "–" }),
          h("td", { text: job ? methodOf(job) : "–" }),
          h("td", { class: "num", text: String(values.length) }),
          h("td", { class: "num", text: fmtNum(values.at(-1)) }),
          h("td", { class: "num", text: values.length ? fmtNum(Math.min(...values)) : "–" }),
          h("td", { class: "num", text: values.length ? fmtNum(Math.max(...values)) : "–" }),
        );
      }),
    );
    table.hidden = chosen.length === 0;
  }

  let listed = false;
  const missing = new Set(); // selected ids the API does not know (another tenant's, or deleted)
  async function tick() {
    const problems = [];
    try {
      if (!listed || jobs.some((j) => selected.includes(j.id) && !TERMINAL.has(j.status))) {
        jobs = await listAll("/fine_tuning/jobs", { max: MAX_JOBS_LISTED });
        listed = true;
      }
      for (const id of selected) {
        const job = jobs.find((j) => j.id === id);
        const s = series.get(id);
        if (missing.has(id) || (s && s.done)) continue;
        try {
          const after = s?.lastStep ?? null;
          const page = await api(`/fine_tuning/jobs/${id}/metrics${after === null ? "" : `?after_step=${after}`}`);
          const target = s ?? new Series();
          target.append(page.data);
          target.done = !job || TERMINAL.has(job.status); // a job older than the list: read once
          series.set(id, target);
        } catch (err) {
          if (err.status !== 404) throw err;
          missing.add(id);
        }
      }
    } catch (err) {
      problems.push(err.message);
    }
    for (const id of missing) problems.push(`No such fine-tuning job: '${id}'`);
    errorBox.textContent = problems.join(" · ");
    errorBox.hidden = problems.length === 0;
    renderPicker();
    renderMetricOptions();
    renderChart();
    syncAddress();
    return selected.some((id) => !series.get(id)?.done && !missing.has(id));
  }

  const poll = poller(tick, 2000);
  metricSelect.addEventListener("change", () => {
    metric = metricSelect.value;
    syncAddress();
    renderChart();
  });
  return () => {
    poll.stop();
    chart?.destroy();
  };
}
