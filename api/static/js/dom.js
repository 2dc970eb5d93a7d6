// Small DOM and formatting helpers. Every piece of data goes into the page as text (textContent), never as HTML:
// completions, prompts and event messages are user- or model-written.

import { TERMINAL, statusLabel } from "./status.js";

/** h("a", {href, class, onClick, dataset: {...}}, ...children): an element; children are nodes, strings or arrays. */
export function h(tag, props = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(props ?? {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "class") el.className = value;
    else if (name === "text") el.textContent = value;
    else if (name === "dataset") Object.assign(el.dataset, value);
    else if (name.startsWith("on") && typeof value === "function") el.addEventListener(name.slice(2).toLowerCase(), value);
    else if (value === true) el.setAttribute(name, "");
    else el.setAttribute(name, String(value));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    if (Array.isArray(child)) append(el, child);
    else el.append(child instanceof Node ? child : String(child));
  }
}

export function clear(el) {
  el.replaceChildren();
  return el;
}

/** Focus the view's heading after navigation, so keyboard and screen-reader users start at the new page. */
export function focusHeading(root) {
  const heading = root.querySelector("h1");
  if (heading) {
    heading.tabIndex = -1;
    heading.focus({ preventScroll: true });
  }
}

/** Announce a short message to screen readers (and keep it visible to no one). */
export function announce(message) {
  const region = document.getElementById("announcer");
  if (region) region.textContent = message;
}

// -- formatting ------------------------------------------------------------------------------------------------

const pad = (n) => String(n).padStart(2, "0");

export function fmtTime(unix) {
  if (unix === null || unix === undefined) return "–";
  const d = new Date(unix * 1000);
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}

export function fmtClock(unix) {
  const d = new Date(unix * 1000);
  return `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}

export function fmtDuration(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return "–";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s}s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m}m ${pad(s % 60)}s`;
  const hours = Math.floor(m / 60);
  if (hours < 48) return `${hours}h ${pad(m % 60)}m`;
  return `${Math.floor(hours / 24)}d ${hours % 24}h`;
}

/** A metric value, compact: 4 significant digits, thousands grouped, exponents for the very small. */
export function fmtNum(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (!Number.isFinite(v)) return v > 0 ? "∞" : "−∞";
  const a = Math.abs(v);
  if (a === 0) return "0";
  if (a >= 1e4) return Math.round(v).toLocaleString("en-US");
  if (a < 1e-3) return v.toExponential(2);
  return String(Number(v.toPrecision(4)));
}

export function fmtCount(n) {
  return n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US");
}

export const now = () => Date.now() / 1000;

// -- jobs ------------------------------------------------------------------------------------------------------

export function statusBadge(status) {
  return h("span", { class: `badge badge-${status}`, text: statusLabel(status) });
}

export const methodOf = (job) => job?.method?.type ?? "–";

/** Seconds from creation to the end (or to now while the job lives). */
export function jobDuration(job) {
  if (job.finished_at) return job.finished_at - job.created_at;
  return TERMINAL.has(job.status) ? null : now() - job.created_at;
}

export function shortId(id) {
  return id.length > 18 ? `${id.slice(0, 14)}…` : id;
}

// -- polling ---------------------------------------------------------------------------------------------------

/** Run `tick` now and again `interval()` ms after each run finishes, while the tab is visible, until stopped or
 * `tick` returns false (then `now()` starts it again, e.g. after a button press). Returns {stop, now}. */
export function poller(tick, interval) {
  let timer = null;
  let stopped = false; // for good: the view is gone
  let idle = false; // tick returned false: wait for now()
  let running = false;
  let again = false;

  async function run() {
    clearTimeout(timer);
    timer = null;
    if (stopped) return;
    if (running) {
      again = true;
      return;
    }
    running = true;
    idle = false;
    let keep = true;
    try {
      keep = (await tick()) !== false;
    } catch (err) {
      console.warn("refresh failed", err);
    } finally {
      running = false;
    }
    if (stopped) return;
    if (again) {
      again = false;
      run();
    } else if (keep) {
      schedule();
    } else {
      idle = true;
    }
  }

  function schedule() {
    if (document.hidden) return; // resumed by the visibilitychange listener
    timer = setTimeout(run, typeof interval === "function" ? interval() : interval);
  }

  function onVisible() {
    if (!document.hidden && timer === null && !running && !stopped && !idle) run();
  }

  document.addEventListener("visibilitychange", onVisible);
  run();
  return {
    stop() {
      stopped = true;
      clearTimeout(timer);
      document.removeEventListener("visibilitychange", onVisible);
    },
    now: run,
  };
}
