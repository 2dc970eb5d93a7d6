// Which charts a job page shows, from the metric names its series hold. The names come from ./vocabulary.js, which
// the server generates from trainer/spec/metrics.py (the trainer's one definition of them): a name it does not define is
// an import error at load, not a chart that stays empty. A fixed, preferred set comes first in a sensible order; a
// chart whose series are all absent is not shown; every other numeric series gets its own chart under "Other
// metrics", so names added to the trainer later are drawn without a change here.

import {
  CLIP_FRAC_DUAL,
  CLIP_FRAC_HIGH,
  CLIP_FRAC_LOW,
  COMPLETION_LEN_MAX,
  COMPLETION_LEN_MEAN,
  ENTROPY_MEAN,
  EPISODE_FORMAT_ERROR_FRAC,
  EPISODE_TOOL_CALL_RATE,
  EPISODE_TOOL_CALLS_MEAN,
  EPISODE_TRUNCATED_FRAC,
  EPISODE_TURNS_MEAN,
  EXPLAINED_VARIANCE,
  KL_MEAN,
  LOSS_POLICY,
  LOSS_TOTAL,
  LOSS_VALUE,
  NON_SCORE_REWARD,
  PREFERENCE_ACCURACY,
  RETURNS_MEAN,
  REWARD_MEAN,
  REWARD_OF_GRADER,
  REWARD_STD,
  TOKENS_PER_S_GENERATION,
  TOKENS_PER_S_TRAINING,
  TOOL_CALLS_OF,
  TOOL_ERROR_RATE,
  TOOL_ERRORS_OF,
  TOOL_LATENCY_MEAN,
  TOOL_LATENCY_OF,
  VAL_EPISODE_TOOL_CALL_RATE,
  VAL_LOSS,
  VAL_OVEROPTIMISATION,
  VAL_PREFERENCE_ACCURACY,
  VAL_PREFERENCE_ACCURACY_OF_KIND,
  VAL_REWARD_MEAN,
  VAL_REWARD_OF_GRADER,
  VALUE_CLIP_FRAC,
  VALUE_MEAN,
  VOCABULARY,
} from "./vocabulary.js";

const DEFINED = new Map(VOCABULARY.metrics.map((m) => [m.name, m]));
const FAMILIES = VOCABULARY.families.map((f) => ({ ...f, re: new RegExp(f.regex) }));

/** The trainer's description of a metric name (with its unit), or null for a name it does not define. */
export function describe(name) {
  const def = DEFINED.get(name) ?? FAMILIES.find((f) => f.re.test(name));
  if (!def) return null;
  return def.unit ? `${def.description} (${def.unit})` : def.description;
}

/** The preferred charts, in page order. `series[].band` names a std series drawn as a ±band around the mean;
 * `family` (from the vocabulary) adds one series per metric of that family, labelled with its parameter. */
export const PREFERRED = [
  { id: "reward", title: "Reward", series: [{ key: REWARD_MEAN, label: "mean", band: REWARD_STD }] },
  { id: "reward-graders", title: "Reward by grader", series: [], family: REWARD_OF_GRADER },
  {
    id: "val-reward",
    title: "Validation reward",
    series: [{ key: VAL_REWARD_MEAN, label: "mean" }],
    family: VAL_REWARD_OF_GRADER,
  },
  {
    id: "overoptimisation",
    title: "Over-optimisation: the held-out validation's fall while the learned reward rises",
    series: [{ key: VAL_OVEROPTIMISATION, label: "fall" }],
  },
  {
    id: "preference-accuracy",
    title: "Preference accuracy",
    series: [
      { key: PREFERENCE_ACCURACY, label: "train" },
      { key: VAL_PREFERENCE_ACCURACY, label: "validation" },
    ],
    family: VAL_PREFERENCE_ACCURACY_OF_KIND,
  },
  {
    id: "episodes",
    title: "Agent episodes",
    series: [
      { key: EPISODE_TOOL_CALL_RATE, label: "tool-call rate" },
      { key: VAL_EPISODE_TOOL_CALL_RATE, label: "tool-call rate (validation)" },
      { key: EPISODE_FORMAT_ERROR_FRAC, label: "format errors" },
      { key: EPISODE_TRUNCATED_FRAC, label: "truncated" },
    ],
  },
  {
    id: "episode-turns",
    title: "Turns and tool calls per episode",
    series: [
      { key: EPISODE_TURNS_MEAN, label: "turns" },
      { key: EPISODE_TOOL_CALLS_MEAN, label: "tool calls" },
    ],
  },
  { id: "tool-calls", title: "Calls per episode by tool", series: [], family: TOOL_CALLS_OF },
  {
    id: "tool-errors",
    title: "Tool errors",
    series: [{ key: TOOL_ERROR_RATE, label: "error rate" }],
    family: TOOL_ERRORS_OF,
  },
  {
    id: "tool-latency",
    title: "Tool latency (s)",
    series: [{ key: TOOL_LATENCY_MEAN, label: "mean" }],
    family: TOOL_LATENCY_OF,
  },
  { id: "non-score-reward", title: "Non-score reward (KL penalty)", series: [{ key: NON_SCORE_REWARD, label: "non-score" }] },
  { id: "kl", title: "KL to reference", series: [{ key: KL_MEAN, label: "mean" }] },
  { id: "entropy", title: "Entropy", series: [{ key: ENTROPY_MEAN, label: "mean" }] },
  {
    id: "clip-frac",
    title: "Clip fraction",
    series: [
      { key: CLIP_FRAC_LOW, label: "low" },
      { key: CLIP_FRAC_HIGH, label: "high" },
      { key: CLIP_FRAC_DUAL, label: "dual" },
    ],
  },
  {
    id: "completion-len",
    title: "Completion length (tokens)",
    series: [
      { key: COMPLETION_LEN_MEAN, label: "mean" },
      { key: COMPLETION_LEN_MAX, label: "max" },
    ],
  },
  { id: "loss-policy", title: "Policy loss", series: [{ key: LOSS_POLICY, label: "policy" }] },
  { id: "loss-value", title: "Value loss", series: [{ key: LOSS_VALUE, label: "value" }] },
  {
    id: "loss",
    title: "Loss",
    series: [
      { key: LOSS_TOTAL, label: "train" },
      { key: VAL_LOSS, label: "validation" },
    ],
  },
  {
    id: "value",
    title: "Value and returns",
    series: [
      { key: VALUE_MEAN, label: "value" },
      { key: RETURNS_MEAN, label: "returns" },
    ],
  },
  {
    id: "value-explained-variance",
    title: "Value explained variance",
    series: [{ key: EXPLAINED_VARIANCE, label: "explained var." }],
  },
  { id: "value-clip-frac", title: "Value clip fraction", series: [{ key: VALUE_CLIP_FRAC, label: "clipped" }] },
  {
    id: "throughput",
    title: "Throughput (tokens/s)",
    series: [
      { key: TOKENS_PER_S_GENERATION, label: "generation" },
      { key: TOKENS_PER_S_TRAINING, label: "training" },
    ],
  },
];

/** The charts for a set of metric names: {preferred: [chart], other: [chart]}; each chart is
 * {id, title, series: [{key, label, band?, description}]} with only the series present. */
export function planCharts(names) {
  const present = new Set(names);
  const used = new Set();
  const preferred = [];
  const withDescription = (s) => ({ ...s, description: describe(s.key) });
  for (const spec of PREFERRED) {
    const series = spec.series.filter((s) => present.has(s.key)).map(withDescription);
    if (spec.family) {
      const re = new RegExp(spec.family.regex);
      for (const name of [...present].sort()) {
        const m = re.exec(name);
        if (m && !series.some((s) => s.key === name)) series.push(withDescription({ key: name, label: m[1] }));
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
    .map((name) => ({ id: `metric:${name}`, title: name, series: [withDescription({ key: name, label: name })] }));
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
