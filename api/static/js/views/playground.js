// A job's playground (#/jobs/<id>/playground): one prompt sampled from the base model and from a chosen checkpoint
// (or the final fine-tuned model) side by side, N samples each with the same seed, through the API's
// POST /v1/chat/completions with the signed-in key. When the job has a grader and the prompt is one of its
// validation file's lines (picked from the file, read through GET /v1/files/{id}/content), each answer gets that
// grader's score from POST /v1/fine_tuning/alpha/graders/run. Model output is shown as text, never as HTML.

import { api } from "../api.js";
import { clear, fmtNum, focusHeading, h } from "../dom.js";

const MAX_PROMPTS = 500; // validation lines offered in the picker
const MAX_SAMPLES = 8;
const DEFAULT_MAX_TOKENS = 64;

/** The grader of the job's method, or null (supervised and preference jobs have none). */
function graderOf(job) {
  const type = job?.method?.type;
  return (type && job.method[type]?.grader) || null;
}

function maxTokensOf(job) {
  const type = job?.method?.type;
  return (type && job.method[type]?.hyperparameters?.max_completion_tokens) || DEFAULT_MAX_TOKENS;
}

/** The user turn a validation line shows in the picker and the prompt box: its last user message's text. */
function lastUserText(messages) {
  const user = [...messages].reverse().find((m) => m.role === "user") ?? messages[messages.length - 1];
  const content = user?.content;
  if (typeof content === "string") return content;
  return Array.isArray(content) ? content.map((p) => p.text ?? "").join("\n") : "";
}

/** The RL prompt lines of a JSONL file: objects with a non-empty `messages` list. */
function parsePrompts(text) {
  const items = [];
  for (const line of text.split("\n")) {
    if (!line.trim()) continue;
    try {
      const item = JSON.parse(line);
      if (item && Array.isArray(item.messages) && item.messages.length) items.push(item);
    } catch {
      // not a prompt line: skip it
    }
    if (items.length >= MAX_PROMPTS) break;
  }
  return items;
}

export function mountPlayground(main, { jobId }) {
  document.title = `Playground · ${jobId} · Proxima`;
  const controller = new AbortController();
  const signal = controller.signal;
  let job = null;
  let grader = null;
  let prompts = []; // validation lines
  let run = 0; // the latest Sample press: older answers arriving late are dropped

  const idOf = (name) => `playground-${name}`;
  const modelSelect = h("select", { id: idOf("model") });
  const promptSelect = h("select", { id: idOf("validation") }, h("option", { value: "", text: "Your own prompt" }));
  const promptBox = h("textarea", { id: idOf("prompt"), rows: 4, placeholder: "Write a prompt (the user's message)" });
  const nInput = h("input", { id: idOf("n"), type: "number", min: 1, max: MAX_SAMPLES, step: 1, value: 4 });
  const tempInput = h("input", { id: idOf("temperature"), type: "number", min: 0, max: 2, step: 0.1, value: 1 });
  const tokensInput = h("input", { id: idOf("max-tokens"), type: "number", min: 1, step: 1, value: DEFAULT_MAX_TOKENS });
  const seedInput = h("input", { id: idOf("seed"), type: "number", step: 1, value: 1234 });
  const sampleBtn = h("button", { type: "submit", class: "btn btn-primary", text: "Sample" });
  const formError = h("p", { class: "error-box", role: "alert", hidden: true });
  const gradingNote = h("p", { class: "help", id: idOf("grading") });
  const results = h("div", { class: "playground-results", id: idOf("results") });

  const field = (label, input, extra = null) =>
    h("div", { class: "field" }, h("label", { for: input.id, text: label }), input, extra);
  const form = h(
    "form",
    { class: "panel playground-form", novalidate: true },
    h(
      "div",
      { class: "form-grid" },
      field("Compare the base with", modelSelect),
      field("Validation prompt", promptSelect, gradingNote),
    ),
    field("Prompt", promptBox),
    h(
      "div",
      { class: "form-grid form-grid-dense" },
      field("Samples each", nInput),
      field("Temperature", tempInput),
      field("Max tokens", tokensInput),
      field("Seed", seedInput),
    ),
    formError,
    h("div", { class: "form-actions" }, sampleBtn),
  );

  main.append(
    h(
      "div",
      { class: "page-head" },
      h(
        "div",
        { class: "title-block" },
        h("nav", { "aria-label": "Breadcrumb", class: "crumbs" }, h("a", { href: "#/jobs", text: "Jobs" }), " / ", h("a", { href: `#/jobs/${jobId}`, class: "mono", text: jobId }), " / "),
        h("h1", { text: "Playground" }),
      ),
    ),
    form,
    results,
  );
  focusHeading(main);

  function showError(message) {
    formError.textContent = message;
    formError.hidden = !message;
  }

  /** The picked validation line when the prompt box still holds its text (then its answers can be graded). */
  function pickedItem() {
    const index = promptSelect.value;
    if (index === "") return null;
    const item = prompts[Number(index)];
    return item && promptBox.value === lastUserText(item.messages) ? item : null;
  }

  function renderGradingNote() {
    if (!grader) gradingNote.textContent = "This job has no grader: answers are not scored.";
    else if (!job.validation_file) gradingNote.textContent = "This job has no validation file to pick prompts from.";
    else if (pickedItem()) gradingNote.textContent = `Answers are scored with the job's grader (${grader.name ?? grader.type}).`;
    else gradingNote.textContent = "Pick a validation prompt to score the answers with the job's grader.";
  }

  async function load() {
    job = await api(`/fine_tuning/jobs/${jobId}`, { signal });
    grader = graderOf(job);
    tokensInput.value = String(maxTokensOf(job));
    const checkpoints = (await api(`/fine_tuning/jobs/${jobId}/checkpoints?limit=100`, { signal })).data;
    const options = [];
    if (job.fine_tuned_model) options.push(h("option", { value: job.fine_tuned_model, text: `Final model · ${job.fine_tuned_model}` }));
    for (const c of checkpoints) {
      options.push(h("option", { value: c.fine_tuned_model_checkpoint, text: `Step ${c.step_number} · ${c.fine_tuned_model_checkpoint}` }));
    }
    if (!options.length) options.push(h("option", { value: "", text: "No checkpoint yet: the base alone" }));
    modelSelect.replaceChildren(...options);
    if (job.validation_file) {
      try {
        const response = await api(`/files/${job.validation_file}/content`, { raw: true, signal });
        prompts = parsePrompts(await response.text());
      } catch (err) {
        if (err.name === "AbortError") throw err;
        prompts = []; // deleted: the picker stays empty
      }
      promptSelect.append(
        ...prompts.map((item, i) => {
          const text = lastUserText(item.messages);
          return h("option", { value: String(i), text: `${i + 1}. ${text.length > 80 ? `${text.slice(0, 79)}…` : text}` });
        }),
      );
    }
    promptSelect.disabled = prompts.length === 0;
    renderGradingNote();
  }

  function sampleList(side, label, model) {
    const list = h("ol", { class: "samples", "aria-label": `${label} samples` });
    const status = h("p", { class: "muted", text: "Sampling…" });
    const mean = h("span", { class: "mean-score" });
    const column = h(
      "section",
      { class: "panel playground-side", dataset: { side, model } },
      h("h2", {}, label, " ", mean),
      h("p", { class: "mono muted model-name", text: model }),
      status,
      list,
    );
    return { column, list, status, mean };
  }

  async function grade(item, text) {
    const result = await api("/fine_tuning/alpha/graders/run", { method: "POST", json: { grader, model_sample: text, item }, signal });
    return result.reward;
  }

  async function fill(view, model, messages, params, item, mine) {
    let completion;
    try {
      completion = await api("/chat/completions", { method: "POST", json: { model, messages, ...params }, signal });
    } catch (err) {
      if (err.name === "AbortError" || mine !== run) return;
      view.status.textContent = `Failed: ${err.message}`;
      view.status.className = "error-box";
      return;
    }
    if (mine !== run) return;
    view.status.hidden = true;
    const scores = [];
    const rows = completion.choices.map((choice) => {
      const score = h("span", { class: "sample-score" });
      const row = h(
        "li",
        { class: "sample", dataset: { finish: choice.finish_reason } },
        h("pre", { class: "sample-text", text: choice.message.content ?? "" }),
        h("span", { class: "muted sample-meta" }, choice.finish_reason === "length" ? "cut at max tokens " : "", score),
      );
      if (item) {
        scores.push(
          grade(item, choice.message.content ?? "").then(
            (reward) => {
              score.textContent = `score ${fmtNum(reward)}`;
              score.dataset.score = String(reward);
              return reward;
            },
            (err) => {
              if (err.name !== "AbortError") score.textContent = `not scored: ${err.message}`;
              return null;
            },
          ),
        );
      }
      return row;
    });
    view.list.replaceChildren(...rows);
    if (scores.length) {
      const rewards = (await Promise.all(scores)).filter((r) => r !== null);
      if (mine === run && rewards.length) {
        const avg = rewards.reduce((a, b) => a + b, 0) / rewards.length;
        view.mean.textContent = `mean score ${fmtNum(avg)}`;
        view.mean.dataset.score = String(avg);
      }
    }
  }

  form.addEventListener("submit", (e) => {
    e.preventDefault();
    showError("");
    const text = promptBox.value;
    if (!text.trim()) {
      showError("Write a prompt or pick a validation prompt.");
      promptBox.focus();
      return;
    }
    const n = Number(nInput.value);
    if (!Number.isInteger(n) || n < 1 || n > MAX_SAMPLES) {
      showError(`Samples each: a whole number from 1 to ${MAX_SAMPLES}.`);
      return;
    }
    const item = grader ? pickedItem() : null;
    // A picked validation line is sent whole (a system message included); a prompt of one's own is one user turn.
    const messages = item ? item.messages : [{ role: "user", content: text }];
    const params = { n, temperature: Number(tempInput.value), max_tokens: Number(tokensInput.value), seed: Number(seedInput.value) };
    const mine = ++run;
    const base = sampleList("base", "Base", job.model);
    const views = [base];
    if (modelSelect.value) {
      const step = modelSelect.selectedOptions[0]?.textContent.split(" · ")[0] ?? "Fine-tuned";
      views.push(sampleList("tuned", step, modelSelect.value));
    }
    results.replaceChildren(h("div", { class: "columns playground-columns" }, ...views.map((v) => v.column)));
    for (const view of views) fill(view, view.column.dataset.model, messages, params, item, mine);
  });

  promptSelect.addEventListener("change", () => {
    const item = prompts[Number(promptSelect.value)];
    if (promptSelect.value !== "" && item) promptBox.value = lastUserText(item.messages);
    renderGradingNote();
  });
  promptBox.addEventListener("input", renderGradingNote);

  load().catch((err) => {
    if (err.name === "AbortError") return;
    clear(main).append(
      h("h1", { text: err.status === 404 ? "Job not found" : "The playground could not load" }),
      h("p", { class: "error-box", role: "alert", text: err.message }),
      h("p", {}, h("a", { href: "#/jobs", text: "Back to the jobs" })),
    );
    focusHeading(main);
  });

  return () => controller.abort();
}
