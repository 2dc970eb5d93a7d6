// Which charts a job page shows, from the metric names its series hold (the vocabulary is trainer/metrics.py).
// A fixed, preferred set comes first in a sensible order; a chart whose series are all absent is not shown; every
// other numeric series gets its own chart under "Other metrics", so names added later are drawn without a change
// here.

const SUB_REWARD = /^reward\/(.+)\/mean$/;
const VAL_SUB_REWARD = /^val\/reward\/(.+)\/mean$/;

/** The preferred charts, in page order. `series[].band` names a std series drawn as a ±band around the mean;
 * `match` adds one series per metric whose name matches (the capture is its label). */
export const PREFERRED = [
  { id: "reward", title: "Reward", series: [{ key: "reward/mean", label: "mean", band: "reward/std" }] },
  { id: "reward-graders", title: "Reward by grader", series: [], match: SUB_REWARD, except: ["reward/mean"] },
  {
    id: "val-reward",
    title: "Validation reward",
    series: [{ key: "val/reward/mean", label: "mean" }],
    match: VAL_SUB_REWARD,
  },
  { id: "non-score-reward", title: "Non-score reward (KL penalty)", series: [{ key: "reward/non_score", label: "non-score" }] },
  { id: "kl", title: "KL to reference", series: [{ key: "kl/mean", label: "mean" }] },
  { id: "entropy", title: "Entropy", series: [{ key: "entropy/mean", label: "mean" }] },
  {
    id: "clip-frac",
    title: "Clip fraction",
    series: [
      { key: "clip_frac/low", label: "low" },
      { key: "clip_frac/high", label: "high" },
      { key: "clip_frac/dual", label: "dual" },
    ],
  },
  {
    id: "completion-len",
    title: "Completion length (tokens)",
    series: [
      { key: "completion_len/mean", label: "mean" },
      { key: "completion_len/max", label: "max" },
    ],
  },
  { id: "loss-policy", title: "Policy loss", series: [{ key: "loss/policy", label: "policy" }] },
  { id: "loss-value", title: "Value loss", series: [{ key: "loss/value", label: "value" }] },
  {
    id: "loss-train",
    title: "Loss",
    series: [
      { key: "loss/train", label: "train" },
      { key: "loss/val", label: "validation" },
    ],
  },
  {
    id: "value",
    title: "Value and returns",
    series: [
      { key: "value/mean", label: "value" },
      { key: "returns/mean", label: "returns" },
    ],
  },
  {
    id: "value-explained-variance",
    title: "Value explained variance",
    series: [{ key: "value/explained_variance", label: "explained var." }],
  },
  { id: "value-clip-frac", title: "Value clip fraction", series: [{ key: "value/clip_frac", label: "clipped" }] },
  {
    id: "throughput",
    title: "Throughput (tokens/s)",
    series: [
      { key: "throughput/generation_tokens_per_s", label: "generation" },
      { key: "throughput/training_tokens_per_s", label: "training" },
    ],
  },
];

/** The charts for a set of metric names: {preferred: [chart], other: [chart]}; each chart is
 * {id, title, series: [{key, label, band?}]} with only the series present. */
export function planCharts(names) {
  const present = new Set(names);
  const used = new Set();
  const preferred = [];
  for (const spec of PREFERRED) {
    const series = spec.series.filter((s) => present.has(s.key));
    if (spec.match) {
      for (const name of [...present].sort()) {
        const m = spec.match.exec(name);
        if (m && !(spec.except ?? []).includes(name) && !series.some((s) => s.key === name)) {
          series.push({ key: name, label: m[1] });
        }
      }
    }
    for (const s of series) {
      used.add(s.key);
      if (s.band && present.has(s.band)) used.add(s.band);
    }
    if (series.length) preferred.push({ id: spec.id, title: spec.title, series });
  }
  const other = [...present]
    .filter((name) => !used.has(name))
    .sort()
    .map((name) => ({ id: `metric:${name}`, title: name, series: [{ key: name, label: name }] }));
  return { preferred, other };
}

/** Every metric name in a series of points ({step, metrics}), sorted, for pickers. */
export function metricNames(points) {
  const names = new Set();
  for (const p of points) for (const [k, v] of Object.entries(p.metrics)) if (typeof v === "number") names.add(k);
  return [...names].sort();
}

/** Points ({step, metrics}) as columns: {steps: [..], col(name) → values aligned with steps (null if absent)}. */
export class Series {
  constructor() {
    this.steps = [];
    this.columns = new Map();
  }

  get length() {
    return this.steps.length;
  }

  get lastStep() {
    return this.steps.length ? this.steps[this.steps.length - 1] : null;
  }

  /** Append points with steps after the last one (the API gives them in step order). */
  append(points) {
    for (const p of points) {
      if (this.lastStep !== null && p.step <= this.lastStep) continue;
      const i = this.steps.length;
      this.steps.push(p.step);
      for (const [name, v] of Object.entries(p.metrics)) {
        if (typeof v !== "number") continue;
        let col = this.columns.get(name);
        if (!col) {
          col = new Array(i).fill(null);
          this.columns.set(name, col);
        }
        col.push(v);
      }
      for (const col of this.columns.values()) if (col.length < i + 1) col.push(null);
    }
  }

  names() {
    return [...this.columns.keys()];
  }

  col(name) {
    return this.columns.get(name) ?? new Array(this.steps.length).fill(null);
  }
}
