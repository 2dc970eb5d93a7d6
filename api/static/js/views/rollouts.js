// The sampled rollouts of one step: prompt, completion, reward, per-grader rewards and advantage, to see what the
// policy learns (and whether it games the reward). Follows the latest step while the job runs.

import { api } from "../api.js";
import { clear, fmtNum, focusHeading, h, poller, statusBadge } from "../dom.js";
import { TERMINAL } from "../status.js";

const SORTS = {
  sampled: { label: "as sampled", cmp: null },
  "reward-desc": { label: "reward, high first", cmp: (a, b) => b.reward - a.reward },
  "reward-asc": { label: "reward, low first", cmp: (a, b) => a.reward - b.reward },
  "advantage-desc": { label: "advantage, high first", cmp: (a, b) => b.advantage - a.advantage },
  "advantage-asc": { label: "advantage, low first", cmp: (a, b) => a.advantage - b.advantage },
};

function promptText(prompt) {
  if (typeof prompt === "string") return [h("span", { class: "msg-content", text: prompt })];
  if (!Array.isArray(prompt)) return [h("span", { class: "msg-content", text: JSON.stringify(prompt) })];
  return prompt.map((m) =>
    h("div", { class: "msg" }, h("span", { class: "msg-role", text: m.role }), h("span", { class: "msg-content", text: typeof m.content === "string" ? m.content : JSON.stringify(m.content) })),
  );
}

// An agent episode as a conversation: each assistant turn with the tool calls it made, each tool result, then the
// episode's counts (turns, calls, errors; a format error or truncation named).
function episodeView(episode, completion) {
  const turns = (episode.messages ?? []).map((m) => {
    const calls = (m.tool_calls ?? []).map((c) =>
      h("div", { class: "tool-call" }, h("span", { class: "muted", text: "calls " }), h("code", { text: `${c.function?.name}(${c.function?.arguments ?? ""})` })),
    );
    const role = m.role === "tool" ? "tool" : m.role;
    return h(
      "div",
      { class: `msg msg-${role}` },
      h("span", { class: "msg-role", text: role }),
      h("div", { class: "msg-body" }, m.content ? h("span", { class: "msg-content", text: m.content }) : null, calls),
    );
  });
  const notes = [`${episode.turns} turns`, `${episode.tool_calls} tool calls`];
  if (episode.tool_errors) notes.push(`${episode.tool_errors} tool errors`);
  if (episode.format_error) notes.push("ended by a tool call that did not parse");
  if (episode.truncated) notes.push("truncated");
  return h(
    "div",
    { class: "episode", dataset: { turns: String(episode.turns) } },
    turns.length ? turns : h("pre", { text: completion }),
    h("div", { class: "episode-meta muted", text: notes.join(" · ") }),
  );
}

export function mountRollouts(main, { jobId, step }) {
  document.title = `Rollouts · ${jobId} · Proxima`;
  const base = `/fine_tuning/jobs/${jobId}`;
  let follow = !/^\d+$/.test(step ?? "");
  let shownStep = follow ? null : Number(step);
  let steps = [];
  let rows = [];
  let job = null;

  const badge = h("span", { class: "badge-slot" });
  const stepSelect = h("select", { id: "rollout-step", name: "step" });
  const prev = h("button", { type: "button", class: "btn", text: "← Previous", "aria-label": "Previous step" });
  const next = h("button", { type: "button", class: "btn", text: "Next →", "aria-label": "Next step" });
  const followBox = h("input", { type: "checkbox", id: "follow-latest" });
  followBox.checked = follow;
  const sortSelect = h("select", { id: "rollout-sort" }, Object.entries(SORTS).map(([value, s]) => h("option", { value, text: s.label })));
  const stats = h("p", { class: "muted stats", "aria-live": "polite" });
  const errorBox = h("p", { class: "error-box", role: "alert", hidden: true });
  const thead = h("thead");
  const tbody = h("tbody");
  const table = h("table", { class: "table rollouts", id: "rollouts" }, h("caption", { class: "visually-hidden", text: "Sampled rollouts of the step" }), thead, tbody);
  const empty = h("p", { class: "empty", hidden: true, text: "No rollouts yet: they are written after each training step." });

  main.append(
    h(
      "div",
      { class: "page-head" },
      h(
        "div",
        { class: "title-block" },
        h("nav", { "aria-label": "Breadcrumb", class: "crumbs" }, h("a", { href: "#/jobs", text: "Jobs" }), " / ", h("a", { href: `#/jobs/${jobId}`, class: "mono", text: jobId }), " / "),
        h("h1", { text: "Rollouts" }),
        badge,
      ),
    ),
    h(
      "div",
      { class: "toolbar" },
      h("label", { for: "rollout-step", text: "Step" }),
      stepSelect,
      prev,
      next,
      h("label", { class: "inline", for: "follow-latest" }, followBox, " follow latest"),
      h("label", { for: "rollout-sort", text: "Sort" }),
      sortSelect,
    ),
    errorBox,
    stats,
    h("div", { class: "table-wrap" }, table),
    empty,
  );
  focusHeading(main);

  function render() {
    const graders = [...new Set(rows.flatMap((r) => Object.keys(r.rewards ?? {})))];
    thead.replaceChildren(
      h(
        "tr",
        {},
        h("th", { scope: "col", class: "num", text: "#" }),
        h("th", { scope: "col", text: "Prompt" }),
        h("th", { scope: "col", text: "Completion" }),
        h("th", { scope: "col", class: "num", text: "Reward" }),
        graders.map((g) => h("th", { scope: "col", class: "num", text: g, title: `reward of grader ${g}` })),
        h("th", { scope: "col", class: "num", text: "Advantage" }),
        h("th", { scope: "col", class: "num", text: "Tokens" }),
      ),
    );
    const cmp = SORTS[sortSelect.value].cmp;
    const ordered = rows.map((r, i) => ({ ...r, n: i + 1 }));
    if (cmp) ordered.sort(cmp);
    tbody.replaceChildren(
      ...ordered.map((r) =>
        h(
          "tr",
          {},
          // data-label: the column's name, shown in front of the value where the table is laid out as cards.
          h("td", { class: "num muted", "data-label": "#", text: String(r.n) }),
          h("td", { class: "prompt" }, promptText(r.prompt)),
          h(
            "td",
            { class: "completion" },
            r.episode
              ? episodeView(r.episode, r.completion)
              : r.completion === ""
                ? h("span", { class: "muted", text: "(empty)" })
                : h("pre", { text: r.completion }),
          ),
          h("td", { class: "num", "data-label": "Reward", text: fmtNum(r.reward) }),
          graders.map((g) => h("td", { class: "num", "data-label": g, text: fmtNum(r.rewards?.[g]) })),
          h("td", {
            class: `num ${r.advantage > 0 ? "pos" : r.advantage < 0 ? "neg" : ""}`,
            "data-label": "Advantage",
            text: `${r.advantage > 0 ? "+" : ""}${fmtNum(r.advantage)}`,
          }),
          h("td", { class: "num", "data-label": "Tokens", text: String(r.length ?? "–") }),
        ),
      ),
    );
    table.hidden = rows.length === 0;
    empty.hidden = rows.length !== 0;
    const mean = rows.length ? rows.reduce((s, r) => s + r.reward, 0) / rows.length : null;
    clear(stats);
    if (shownStep !== null) {
      stats.append(`Step ${shownStep} · ${rows.length} samples · mean reward ${fmtNum(mean)}`);
      if (graders.length) stats.append(` · graders: ${graders.join(", ")}`);
    }
    // the step picker
    const want = steps.map(String).join();
    if ([...stepSelect.options].map((o) => o.value).join() !== want) {
      stepSelect.replaceChildren(...steps.map((s) => h("option", { value: String(s), text: `step ${s}` })));
    }
    if (shownStep !== null) stepSelect.value = String(shownStep);
    const i = steps.indexOf(shownStep);
    prev.disabled = i <= 0;
    next.disabled = i < 0 || i >= steps.length - 1;
    stepSelect.disabled = steps.length === 0;
  }

  async function load(stepNumber) {
    try {
      const page = await api(`${base}/rollouts${stepNumber === null ? "" : `?step=${stepNumber}`}`);
      steps = page.steps;
      shownStep = page.step;
      rows = page.data;
      errorBox.hidden = true;
    } catch (err) {
      errorBox.textContent = err.message;
      errorBox.hidden = false;
      if (err.status === 404 && stepNumber !== null) return load(null);
      throw err;
    }
    render();
  }

  function go(stepNumber) {
    follow = false;
    followBox.checked = false;
    history.replaceState(null, "", `#/jobs/${jobId}/rollouts?step=${stepNumber}`);
    load(stepNumber).catch(() => {});
  }

  let first = true;
  async function tick() {
    try {
      job = await api(base);
    } catch (err) {
      if (err.status !== 404) throw err;
      errorBox.textContent = err.message;
      errorBox.hidden = false;
      return false;
    }
    badge.replaceChildren(statusBadge(job.status));
    if (follow || first) {
      first = false;
      await load(follow ? null : shownStep);
    }
    return follow && !TERMINAL.has(job.status);
  }

  const poll = poller(tick, 2000);

  stepSelect.addEventListener("change", () => go(Number(stepSelect.value)));
  prev.addEventListener("click", () => go(steps[steps.indexOf(shownStep) - 1]));
  next.addEventListener("click", () => go(steps[steps.indexOf(shownStep) + 1]));
  followBox.addEventListener("change", () => {
    follow = followBox.checked;
    if (follow) {
      history.replaceState(null, "", `#/jobs/${jobId}/rollouts`);
      poll.now();
    }
  });
  sortSelect.addEventListener("change", render);
  return () => poll.stop();
}
