// Create a job: upload datasets (POST /v1/files) or pick uploaded ones, choose method and base model, write the
// grader, set the main hyperparameters. The server validates (the form does not second-guess it): a 400's `param`
// (a dotted path such as method.grpo.hyperparameters.learning_rate) puts its message next to the matching field.

import { ApiError, api } from "../api.js";
import { clear, fmtCount, focusHeading, h } from "../dom.js";

const METHODS = [
  { value: "grpo", label: "GRPO: group-normalised advantages", kind: "rl" },
  { value: "dr_grpo", label: "Dr. GRPO: group mean, no std, no KL", kind: "rl" },
  { value: "dapo", label: "DAPO: clip-higher, dynamic sampling", kind: "rl" },
  { value: "rloo", label: "RLOO: leave-one-out baseline", kind: "rl" },
  { value: "reinforce", label: "REINFORCE with a baseline", kind: "rl" },
  { value: "ppo", label: "PPO with a value model", kind: "rl" },
  { value: "reward_model", label: "Reward model from preferences", kind: "preference" },
  { value: "dpo", label: "DPO from preferences", kind: "preference" },
  { value: "supervised", label: "Supervised fine-tuning", kind: "supervised" },
];

const DEFAULT_GRADER = {
  type: "string_check",
  name: "accuracy",
  input: "{{sample.output_text}}",
  reference: "{{item.answer}}",
  operation: "eq",
};

// A starting point for each of OpenAI's grader types (and ours), in OpenAI's shapes: picking one fills the grader
// field, to be edited. Model graders name a judge model the deployment offers (a 400 lists them).
const TASK = "Task: {{item.messages.0.content}}\nAnswer: {{sample.output_text}}";
const GRADER_TEMPLATES = {
  string_check: DEFAULT_GRADER,
  text_similarity: {
    type: "text_similarity",
    name: "similarity",
    input: "{{sample.output_text}}",
    reference: "{{item.answer}}",
    evaluation_metric: "fuzzy_match",
  },
  python: {
    type: "python",
    name: "python",
    source: 'def grade(sample, item) -> float:\n    return float(sample["output_text"].strip() == item["answer"])\n',
  },
  score_model: {
    type: "score_model",
    name: "judge",
    model: "judge",
    input: [
      { role: "system", content: "Score how well the answer solves the task, from 0 (wrong) to 1 (right)." },
      { role: "user", content: TASK },
    ],
    range: [0, 1],
  },
  label_model: {
    type: "label_model",
    name: "label",
    model: "judge",
    input: [{ role: "user", content: `Is the answer correct? Reply correct or incorrect.\n${TASK}` }],
    labels: ["correct", "incorrect"],
    passing_labels: ["correct"],
  },
  endpoint: { type: "endpoint", name: "endpoint", url: "https://grader.example.com/grade", rate_limit: 10 },
  multi: {
    type: "multi",
    name: "combined",
    graders: {
      exact: { ...DEFAULT_GRADER, name: "exact" },
      close: {
        type: "text_similarity",
        name: "close",
        input: "{{sample.output_text}}",
        reference: "{{item.answer}}",
        evaluation_metric: "fuzzy_match",
      },
    },
    calculate_output: "0.8 * exact + 0.2 * close",
  },
  numeric_match: { type: "numeric_match", name: "number", input: "{{sample.output_text}}", reference: "{{item.answer}}" },
  regex: { type: "regex", name: "digits", input: "{{sample.output_text}}", pattern: "^\\d+$" },
  length_penalty: { type: "length_penalty", name: "short", input: "{{sample.output_text}}", max_chars: 200 },
};

// name, label, integer?, which kinds of method show it, help
const HYPERPARAMETERS = [
  ["learning_rate", "Learning rate", false, "all", "LoRA learning rate"],
  ["max_steps", "Max steps", true, "all", "default: n_epochs over the data"],
  ["batch_size", "Batch size", true, "all", "prompts (examples) per step"],
  ["group_size", "Group size", true, "rl", "samples per prompt"],
  ["max_completion_tokens", "Max completion tokens", true, "rl", ""],
  ["temperature", "Temperature", false, "rl", "sampling temperature"],
  ["beta", "β (KL coefficient)", false, "rl", "0 skips the reference model"],
  ["checkpoint_interval", "Checkpoint interval", true, "all", "steps between checkpoints"],
  ["eval_interval", "Eval interval", true, "all", "0: validate only at the end"],
];

export function mountCreate(main) {
  document.title = "New job · Proxima";
  const fields = new Map(); // name → {wrap, input, error}
  const kindOf = (type) => METHODS.find((m) => m.value === type)?.kind ?? "rl";

  function field(name, label, input, { param, help, extra } = {}) {
    input.id ||= `f-${name}`;
    input.name ||= name;
    const error = h("p", { class: "field-error", id: `${input.id}-error`, role: "alert" });
    const helpEl = help ? h("p", { class: "help", id: `${input.id}-help`, text: help }) : null;
    input.setAttribute("aria-describedby", [helpEl ? helpEl.id : null, error.id].filter(Boolean).join(" "));
    const wrap = h("div", { class: "field", dataset: { param: param ?? name } }, h("label", { for: input.id, text: label }), input, extra ?? null, helpEl, error);
    fields.set(name, { wrap, input, error });
    return wrap;
  }

  // -- datasets ----------------------------------------------------------------------------------------------------
  function fileField(name, label, { optional }) {
    const select = h("select", {});
    const upload = h("input", { type: "file", accept: ".jsonl,.json,application/jsonl,application/json", "aria-label": `Upload a ${label.toLowerCase()}` });
    const status = h("span", { class: "muted upload-status", "aria-live": "polite" });
    const wrap = field(name, label, select, {
      help: optional ? "Optional: periodic evaluation on held-out prompts." : "JSONL, one example a line.",
      extra: h("div", { class: "upload-row" }, upload, status),
    });
    select.dataset.optional = optional ? "1" : "";
    upload.addEventListener("change", async () => {
      const file = upload.files[0];
      if (!file) return;
      const f = fields.get(name);
      setError(f, null);
      status.textContent = `Uploading ${file.name}…`;
      const form = new FormData();
      form.append("purpose", "fine-tune");
      form.append("file", file, file.name);
      try {
        const obj = await api("/files", { method: "POST", form });
        status.textContent = `Uploaded ${obj.filename} as ${obj.id} (${fmtCount(obj.lines)} lines).`;
        files.unshift(obj);
        fillFiles(obj.id, name);
      } catch (err) {
        status.textContent = "";
        setError(f, err.message);
      } finally {
        upload.value = "";
      }
    });
    return wrap;
  }

  let files = [];
  function fillFiles(chosenId, forField) {
    for (const name of ["training_file", "validation_file"]) {
      const select = fields.get(name).input;
      const keep = name === forField ? chosenId : select.value;
      select.replaceChildren(
        h("option", { value: "", text: select.dataset.optional ? "None" : files.length ? "Choose a file…" : "Upload a file first" }),
        ...files.map((f) => h("option", { value: f.id, text: `${f.filename} · ${f.id} · ${fmtCount(f.lines)} lines` })),
      );
      select.value = files.some((f) => f.id === keep) ? keep : "";
    }
  }

  // -- the form ------------------------------------------------------------------------------------------------------
  const methodSelect = h("select", {}, METHODS.map((m) => h("option", { value: m.value, text: `${m.value} · ${m.label}` })));
  const modelSelect = h("select", {}, h("option", { value: "", text: "Loading…" }));
  const grader = h("textarea", { rows: 9, spellcheck: "false", class: "mono" });
  grader.value = JSON.stringify(DEFAULT_GRADER, null, 2);
  const graderTemplate = h(
    "select",
    { "aria-label": "Start the grader from a template" },
    h("option", { value: "", text: "Start from a template…" }),
    Object.keys(GRADER_TEMPLATES).map((t) => h("option", { value: t, text: t })),
  );
  const graderCheck = h("button", { type: "button", class: "btn btn-small", text: "Check grader" });
  const graderOk = h("span", { class: "ok", "aria-live": "polite" });
  const extra = h("textarea", { rows: 3, spellcheck: "false", class: "mono", placeholder: '{"epsilon_high": 0.28}' });
  const formError = h("div", { class: "error-box", role: "alert", hidden: true });
  const submit = h("button", { type: "submit", class: "btn btn-primary", text: "Create job" });

  const hpFields = HYPERPARAMETERS.map(([name, label, integer, kinds, help]) => {
    const input = h("input", { type: "number", step: "any", inputmode: integer ? "numeric" : "decimal", placeholder: "default" });
    const wrap = field(name, label, input, { param: `method.{m}.hyperparameters.${name}`, help });
    wrap.dataset.kinds = kinds;
    fields.get(name).integer = integer;
    return wrap;
  });
  const loraR = h("input", { type: "number", step: "1", placeholder: "16" });
  const loraAlpha = h("input", { type: "number", step: "any", placeholder: "32" });

  const graderWrap = field("grader", "Grader (JSON)", grader, {
    param: "method.{m}.grader",
    help:
      "OpenAI's grader object: string_check, text_similarity, python, score_model, label_model, endpoint, multi; " +
      "or numeric_match, regex, length_penalty, reward_model.",
    extra: h("div", { class: "upload-row" }, graderTemplate, graderCheck, graderOk),
  });

  const form = h(
    "form",
    { class: "create-form", novalidate: true },
    formError,
    h(
      "fieldset",
      {},
      h("legend", { text: "Data" }),
      h("div", { class: "form-grid" }, fileField("training_file", "Training file", { optional: false }), fileField("validation_file", "Validation file", { optional: true })),
    ),
    h(
      "fieldset",
      {},
      h("legend", { text: "Method and model" }),
      h(
        "div",
        { class: "form-grid" },
        field("method", "Method", methodSelect, { param: "method.type" }),
        field("model", "Base model", modelSelect),
        field("suffix", "Suffix", h("input", { type: "text", maxlength: 64, placeholder: "my-run", autocomplete: "off" }), { help: "Part of the fine-tuned model's name." }),
        field("seed", "Seed", h("input", { type: "number", step: "1", placeholder: "random" })),
      ),
      graderWrap,
    ),
    h(
      "fieldset",
      {},
      h("legend", { text: "Hyperparameters" }),
      h("p", { class: "help", text: "Every field is optional; empty fields take the method's default (from its paper)." }),
      h("div", { class: "form-grid form-grid-dense" }, hpFields, field("lora_r", "LoRA rank r", loraR, { param: "method.{m}.lora.r" }), field("lora_alpha", "LoRA α", loraAlpha, { param: "method.{m}.lora.alpha" })),
      field("extra", "More hyperparameters (JSON object)", extra, { param: "method.{m}.hyperparameters", help: "Any other hyperparameter of the method, e.g. warmup_steps, lr_scheduler, epsilon_high, kl_estimator." }),
    ),
    h("div", { class: "form-actions" }, submit, h("a", { class: "btn btn-quiet", href: "#/jobs", text: "Cancel" })),
  );

  main.append(h("div", { class: "page-head" }, h("h1", { text: "New fine-tuning job" })), form);
  focusHeading(main);

  function syncMethod() {
    const kind = kindOf(methodSelect.value);
    graderWrap.hidden = kind !== "rl";
    for (const wrap of hpFields) wrap.hidden = wrap.dataset.kinds !== "all" && wrap.dataset.kinds !== kind;
  }
  methodSelect.addEventListener("change", syncMethod);
  syncMethod();

  // -- errors --------------------------------------------------------------------------------------------------------
  function setError(f, message) {
    f.error.textContent = message ?? "";
    if (message) f.input.setAttribute("aria-invalid", "true");
    else f.input.removeAttribute("aria-invalid");
    f.wrap.classList.toggle("invalid", Boolean(message));
  }

  function clearErrors() {
    for (const f of fields.values()) setError(f, null);
    formError.hidden = true;
    clear(formError);
  }

  /** The field whose param is the longest prefix (on dots) of the error's param. */
  function fieldFor(param) {
    if (!param) return null;
    let best = null;
    let bestLen = -1;
    for (const f of fields.values()) {
      if (f.wrap.hidden || f.wrap.closest("[hidden]")) continue;
      const p = f.wrap.dataset.param.replace("{m}", methodSelect.value);
      if ((param === p || param.startsWith(`${p}.`) || param.startsWith(`${p}[`)) && p.length > bestLen) {
        best = f;
        bestLen = p.length;
      }
    }
    return best;
  }

  function showApiError(err) {
    const f = err instanceof ApiError ? fieldFor(err.param) : null;
    const message = err.param && err.message.startsWith(`${err.param}: `) ? err.message.slice(err.param.length + 2) : err.message;
    if (f) {
      const sub = f.wrap.dataset.param.replace("{m}", methodSelect.value);
      setError(f, err.param !== sub ? `${err.param.slice(sub.length + 1)}: ${message}` : message);
      f.input.focus();
    }
    formError.replaceChildren(h("strong", { text: "The job was not created. " }), f ? `${message} (see ${f.wrap.querySelector("label").textContent}).` : message);
    formError.hidden = false;
    if (!f) formError.scrollIntoView({ block: "nearest" });
  }

  // -- the body ------------------------------------------------------------------------------------------------------
  function value(name) {
    return fields.get(name).input.value.trim();
  }

  /** The request body, or null after marking the fields that cannot be read (bad JSON, not a number). */
  function body() {
    const type = methodSelect.value;
    let ok = true;
    const number = (name) => {
      const f = fields.get(name);
      if (f.input.validity.badInput) {
        setError(f, "Enter a number.");
        ok = false;
        return undefined;
      }
      return f.input.value === "" ? undefined : Number(f.input.value);
    };
    const json = (name, what) => {
      const text = value(name);
      if (!text) return undefined;
      try {
        const parsed = JSON.parse(text);
        if (parsed === null || typeof parsed !== "object" || Array.isArray(parsed)) throw new Error(`${what} must be a JSON object`);
        return parsed;
      } catch (err) {
        setError(fields.get(name), err instanceof SyntaxError ? `Not valid JSON: ${err.message}` : err.message);
        ok = false;
        return undefined;
      }
    };
    const hp = { ...(json("extra", "More hyperparameters") ?? {}) };
    for (const [name] of HYPERPARAMETERS) {
      if (fields.get(name).wrap.hidden) continue;
      const v = number(name);
      if (v !== undefined) hp[name] = v;
    }
    const block = { hyperparameters: hp };
    if (kindOf(type) === "rl") {
      const g = json("grader", "The grader");
      if (g === undefined && ok) {
        setError(fields.get("grader"), "RL methods need a grader.");
        ok = false;
      }
      block.grader = g;
    }
    const lora = {};
    const r = number("lora_r");
    const alpha = number("lora_alpha");
    if (r !== undefined) lora.r = r;
    if (alpha !== undefined) lora.alpha = alpha;
    if (Object.keys(lora).length) block.lora = lora;
    const out = { model: value("model"), training_file: value("training_file"), method: { type, [type]: block } };
    if (value("validation_file")) out.validation_file = value("validation_file");
    if (value("suffix")) out.suffix = value("suffix");
    const seed = number("seed");
    if (seed !== undefined) out.seed = seed;
    return ok ? out : null;
  }

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    clearErrors();
    const b = body();
    if (!b) {
      form.querySelector("[aria-invalid=true]")?.focus();
      return;
    }
    submit.disabled = true;
    submit.textContent = "Creating…";
    try {
      const job = await api("/fine_tuning/jobs", { method: "POST", json: b });
      location.hash = `#/jobs/${job.id}`;
    } catch (err) {
      showApiError(err);
    } finally {
      submit.disabled = false;
      submit.textContent = "Create job";
    }
  });

  graderTemplate.addEventListener("change", () => {
    const template = GRADER_TEMPLATES[graderTemplate.value];
    if (!template) return;
    grader.value = JSON.stringify(template, null, 2);
    setError(fields.get("grader"), null);
    graderOk.textContent = "";
    graderTemplate.value = "";
    grader.focus();
  });

  graderCheck.addEventListener("click", async () => {
    const f = fields.get("grader");
    setError(f, null);
    graderOk.textContent = "";
    let g;
    try {
      g = JSON.parse(grader.value);
    } catch (err) {
      setError(f, `Not valid JSON: ${err.message}`);
      return;
    }
    try {
      await api("/fine_tuning/alpha/graders/validate", { method: "POST", json: { grader: g } });
      graderOk.textContent = "The grader is valid.";
    } catch (err) {
      setError(f, err.message);
    }
  });

  // -- options from the server ----------------------------------------------------------------------------------------
  (async () => {
    try {
      const [models, fileList] = await Promise.all([api("/models"), api("/files?purpose=fine-tune&limit=1000")]);
      const base = models.data.filter((m) => !m.id.startsWith("ft:"));
      modelSelect.replaceChildren(...base.map((m) => h("option", { value: m.id, text: m.id })));
      files = fileList.data;
      fillFiles(null, null);
    } catch (err) {
      formError.textContent = `Could not load models and files: ${err.message}`;
      formError.hidden = false;
    }
  })();

  return () => {};
}
