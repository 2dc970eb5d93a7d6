// The dashboard's shell: sign-in state, the hash router (#/jobs, #/jobs/<id>, #/jobs/<id>/rollouts, #/compare,
// #/new, #/sessions, #/sessions/<id>, #/evals, #/evals/<id>, #/evals/<id>/runs/<run id>) and the views' lifecycle.
// A view is `mount(main, params) → cleanup`; its cleanup stops its polling.

import { clearKey, getKey } from "./api.js";
import { clear } from "./dom.js";
import { mountCompare } from "./views/compare.js";
import { mountCreate } from "./views/create.js";
import { mountEvalRun } from "./views/eval_run.js";
import { mountEval, mountEvals } from "./views/evals.js";
import { mountJob } from "./views/job.js";
import { mountJobs } from "./views/jobs.js";
import { mountPlayground } from "./views/playground.js";
import { mountRollouts } from "./views/rollouts.js";
import { mountSession, mountSessions } from "./views/sessions.js";
import { mountSignIn } from "./views/signin.js";
import { mountWebhooks } from "./views/webhooks.js";

const main = document.getElementById("main");
let cleanup = null;
let signInNotice = null;

const ROUTES = [
  [/^#\/jobs\/([\w-]+)\/rollouts$/, (m, q) => mountRollouts(main, { jobId: m[1], step: q.get("step") }), "jobs"],
  [/^#\/jobs\/([\w-]+)\/playground$/, (m) => mountPlayground(main, { jobId: m[1] }), "jobs"],
  [/^#\/jobs\/([\w-]+)$/, (m) => mountJob(main, { jobId: m[1] }), "jobs"],
  [/^#\/(?:jobs)?$/, (m, q) => mountJobs(main, { status: q.get("status"), method: q.get("method") }), "jobs"],
  [/^#\/compare$/, (m, q) => mountCompare(main, { jobs: q.get("jobs"), metric: q.get("metric") }), "compare"],
  [/^#\/new$/, () => mountCreate(main), "new"],
  [/^#\/webhooks$/, () => mountWebhooks(main), "webhooks"],
  // A training session's id is the SDK's model id: `<client session>:train:<n>`.
  [/^#\/sessions\/([\w:-]+)$/, (m) => mountSession(main, { sessionId: m[1] }), "sessions"],
  [/^#\/sessions$/, () => mountSessions(main), "sessions"],
  [
    /^#\/evals\/([\w-]+)\/runs\/([\w-]+)$/,
    (m, q) => mountEvalRun(main, { evalId: m[1], runId: m[2], status: q.get("status"), itemId: q.get("item") }),
    "evals",
  ],
  [/^#\/evals\/([\w-]+)$/, (m) => mountEval(main, { evalId: m[1] }), "evals"],
  [/^#\/evals$/, () => mountEvals(main), "evals"],
];

function parseHash() {
  const hash = location.hash || "#/jobs";
  const [path, query = ""] = hash.split("?");
  return { path, query: new URLSearchParams(query) };
}

function showShell(signedIn) {
  document.getElementById("nav").hidden = !signedIn;
  document.getElementById("session").hidden = !signedIn;
  const key = getKey();
  document.getElementById("key-hint").textContent = signedIn && key ? `key …${key.slice(-4)}` : "";
}

function render() {
  cleanup?.();
  cleanup = null;
  clear(main);
  if (!getKey()) {
    showShell(false);
    cleanup = mountSignIn(main, {
      notice: signInNotice,
      onSignedIn: () => {
        signInNotice = null;
        render();
      },
    });
    return;
  }
  showShell(true);
  const { path, query } = parseHash();
  for (const [pattern, mount, nav] of ROUTES) {
    const m = pattern.exec(path);
    if (m) {
      for (const a of document.querySelectorAll("[data-nav]")) {
        if (a.dataset.nav === nav) a.setAttribute("aria-current", "page");
        else a.removeAttribute("aria-current");
      }
      cleanup = mount(m, query);
      return;
    }
  }
  location.replace("#/jobs");
}

function signOut(notice = null) {
  clearKey();
  signInNotice = notice;
  if (location.hash !== "#/jobs") history.replaceState(null, "", "#/jobs");
  render();
}

document.getElementById("sign-out").addEventListener("click", () => signOut());
window.addEventListener("proxima:unauthorized", (e) => signOut(`Signed out: ${e.detail}`));
window.addEventListener("hashchange", render);
// Another tab signed in or out: follow it, so one browser never shows two tenants' data at once.
window.addEventListener("storage", (e) => {
  if (e.key === null || e.key === "proxima.apiKey") render();
});
render();
