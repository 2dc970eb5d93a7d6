// A line chart over training steps (uPlot), with its own legend that shows the latest values, or the values
// at the hovered step. The figure carries data-points (the number of points of its first series) so that tests and
// scripts can read what is drawn.

import uPlot from "../vendor/uPlot.esm.js";
import { fmtNum, h } from "./dom.js";

export const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777", "#475569", "#65a30d"];

function withAlpha(hex, alpha) {
  const n = parseInt(hex.slice(1), 16);
  return `rgba(${(n >> 16) & 255}, ${(n >> 8) & 255}, ${n & 255}, ${alpha})`;
}

function cursorPoint(hidden) {
  return (u, si) => {
    if (hidden.has(si)) return null;
    const el = document.createElement("div");
    Object.assign(el.style, { width: "8px", height: "8px", marginLeft: "-4px", marginTop: "-4px", borderWidth: "2px" });
    return el;
  };
}

/** uPlot's padded range, but a flat series gets a small band around its value (not 0–100). */
function yRange(u, min, max) {
  if (min === null || max === null) return [0, 1];
  if (min === max) {
    const pad = min === 0 ? 1 : Math.abs(min) * 0.1;
    return [min - (min === 0 ? 0 : pad), max + pad];
  }
  return uPlot.rangeNum(min, max, 0.1, true);
}

const AXIS = { stroke: "#475569", font: "11px system-ui, sans-serif", grid: { stroke: "#e2e8f0", width: 1 }, ticks: { show: false } };

export class LineChart {
  /**
   * @param {object} o
   * @param {string} o.id            data-chart of the figure
   * @param {string} o.title
   * @param {{key: string, label: string, band?: string, description?: string}[]} o.series  one line each; `band`
   *   names a std series; `description` (the trainer's) shows on hovering the legend
   * @param {string} [o.sync]        charts with the same key share the hovered step
   * @param {number} [o.height]
   */
  constructor({ id, title, series, sync = null, height = 170 }) {
    this.specs = series;
    this.sync = sync;
    this.height = height;
    this.plot = null;
    this.zoomed = false;
    this.steps = [];
    this.values = [];
    this.stepLabel = h("span", { class: "chart-step" });
    this.legend = h("ul", { class: "chart-legend" });
    this.legendValues = series.map((s, i) => {
      const value = h("span", { class: "legend-value" });
      const swatch = h("i", { class: "swatch", "aria-hidden": "true" });
      swatch.style.background = PALETTE[i % PALETTE.length];
      const title = s.description ? `${s.key}: ${s.description}` : s.key;
      this.legend.append(h("li", { title }, swatch, h("span", { class: "legend-label", text: s.label }), value));
      return value;
    });
    this.area = h("div", { class: "chart-area" });
    this.el = h(
      "figure",
      { class: "chart", dataset: { chart: id, points: "0", series: series.map((s) => s.key).join(" ") } },
      h("figcaption", {}, h("span", { class: "chart-title", text: title }), this.stepLabel, this.legend),
      this.area,
    );
    this.el.setAttribute("aria-label", `${title} chart`);
    this.el.setAttribute("role", "figure");
    this.resize = new ResizeObserver(() => this.#fit());
    this.resize.observe(this.area);
  }

  /** Draw these steps and, per series, its values aligned with them (null where absent). */
  setData(steps, valuesOf) {
    this.steps = steps;
    this.values = this.specs.map((s) => ({ mean: valuesOf(s.key), std: s.band ? valuesOf(s.band) : null }));
    const first = this.values[0]?.mean ?? [];
    this.el.dataset.points = String(first.reduce((n, v) => n + (v === null ? 0 : 1), 0));
    this.#showValues(null);
    const data = this.#data();
    if (!this.plot) {
      if (this.area.isConnected) this.#create(data);
    } else {
      this.plot.setData(data, !this.zoomed);
    }
  }

  destroy() {
    this.resize.disconnect();
    this.plot?.destroy();
    this.plot = null;
  }

  #data() {
    const data = [this.steps];
    for (const { mean, std } of this.values) {
      data.push(mean);
      if (std) {
        data.push(mean.map((m, i) => (m === null || std[i] === null ? null : m + std[i])));
        data.push(mean.map((m, i) => (m === null || std[i] === null ? null : m - std[i])));
      }
    }
    return data;
  }

  #create(data) {
    const series = [{ label: "step" }];
    const bands = [];
    const hidden = new Set();
    this.specs.forEach((s, i) => {
      const color = PALETTE[i % PALETTE.length];
      series.push({ label: s.label, stroke: color, width: 1.5, spanGaps: true, points: { size: 4 } });
      if (s.band) {
        const upper = series.length;
        series.push({ label: `${s.label} + std`, stroke: withAlpha(color, 0), width: 0, spanGaps: true, points: { show: false } });
        series.push({ label: `${s.label} − std`, stroke: withAlpha(color, 0), width: 0, spanGaps: true, points: { show: false } });
        bands.push({ series: [upper, upper + 1], fill: withAlpha(color, 0.15) });
        hidden.add(upper).add(upper + 1);
      }
    });
    const opts = {
      width: Math.max(200, this.area.clientWidth),
      height: this.height,
      series,
      bands,
      legend: { show: false },
      scales: { x: { time: false }, y: { range: yRange } },
      axes: [
        { ...AXIS, size: 28, values: (u, splits) => splits.map((v) => (Number.isInteger(v) ? String(v) : "")) },
        { ...AXIS, size: 52, values: (u, splits) => splits.map(fmtNum) },
      ],
      cursor: {
        drag: { x: true, y: false },
        points: { show: cursorPoint(hidden) },
        ...(this.sync ? { sync: { key: this.sync } } : {}),
      },
      hooks: {
        setCursor: [(u) => this.#showValues(u.cursor.idx)],
        setSelect: [(u) => (this.zoomed ||= u.select.width > 0)],
      },
    };
    this.plot = new uPlot(opts, data, this.area);
    this.plot.over.addEventListener("dblclick", () => (this.zoomed = false));
  }

  #fit() {
    if (!this.area.isConnected) return;
    if (!this.plot) {
      if (this.steps.length) this.#create(this.#data());
      return;
    }
    const width = Math.max(200, this.area.clientWidth);
    if (width !== this.plot.width) this.plot.setSize({ width, height: this.height });
  }

  /** Legend values at a row (the hovered step) or, with null, each series' latest value. */
  #showValues(idx) {
    let step = idx === null || idx === undefined ? null : this.steps[idx];
    this.values.forEach(({ mean, std }, i) => {
      let j = idx;
      if (j === null || j === undefined) {
        j = mean.length - 1;
        while (j >= 0 && mean[j] === null) j--;
        if (i === 0 && j >= 0) step = this.steps[j];
      }
      const m = j >= 0 ? mean[j] : null;
      const s = std && j >= 0 ? std[j] : null;
      this.legendValues[i].textContent = m === null || m === undefined ? "–" : s === null ? fmtNum(m) : `${fmtNum(m)} ± ${fmtNum(s)}`;
    });
    this.stepLabel.textContent = step === null || step === undefined ? "" : `step ${step}`;
  }
}
