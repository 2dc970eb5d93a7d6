// Webhook endpoints: create one (its signing secret is shown once, here), list them, rotate a secret (the new one
// shown once), delete, and read an endpoint's delivery log (every attempt: event, job, HTTP status or error, the
// next retry). The server checks the URL against the deployment's policy; a 400's `param` puts its message next to
// the field it names.

import { ApiError, api, listAll } from "../api.js";
import { fmtTime, focusHeading, h, poller } from "../dom.js";

const REFRESH_MS = 5000;

export function mountWebhooks(main) {
  document.title = "Webhooks · Proxima";
  const state = { endpoints: [], open: null, types: [] };

  const nameInput = h("input", { id: "webhook-name", name: "name", required: true, autocomplete: "off", maxlength: "256" });
  const urlInput = h("input", { id: "webhook-url", name: "url", type: "url", required: true, placeholder: "https://example.com/hooks" });
  const typesBox = h("fieldset", { class: "webhook-types", id: "webhook-event_types" }, h("legend", { text: "Events" }));
  const fieldErrors = {
    name: h("p", { class: "field-error", id: "webhook-name-error", role: "alert" }),
    url: h("p", { class: "field-error", id: "webhook-url-error", role: "alert" }),
    event_types: h("p", { class: "field-error", id: "webhook-event_types-error", role: "alert" }),
  };
  const submit = h("button", { type: "submit", class: "btn btn-primary", text: "Create endpoint" });
  const errorBox = h("p", { class: "error-box", role: "alert", hidden: true });
  const secretBox = h("div", { class: "notice secret-box", role: "status", hidden: true });
  const tbody = h("tbody");
  const empty = h("p", { class: "empty", text: "No webhook endpoints yet.", hidden: true });
  const log = h("section", { class: "panel deliveries", "aria-labelledby": "deliveries-title", hidden: true });

  const form = h(
    "form",
    { class: "create-form webhook-form", novalidate: true },
    h("div", { class: "field" }, h("label", { for: "webhook-name", text: "Name" }), nameInput, fieldErrors.name),
    h("div", { class: "field" }, h("label", { for: "webhook-url", text: "URL" }), urlInput, fieldErrors.url),
    h("div", { class: "field" }, typesBox, fieldErrors.event_types),
    h("div", { class: "form-actions" }, submit),
  );

  main.append(
    h("div", { class: "page-head" }, h("h1", { text: "Webhooks" })),
    h(
      "p",
      { class: "help" },
      "Each endpoint gets a POST, signed as Standard Webhooks, when one of your jobs ends or pauses. Verify it with ",
      h("code", { text: "client.webhooks.unwrap(body, headers, secret=…)" }),
      " of OpenAI's Python client.",
    ),
    h("section", { class: "panel", "aria-labelledby": "new-webhook" }, h("h2", { id: "new-webhook", text: "New endpoint" }), form),
    secretBox,
    errorBox,
    h(
      "div",
      { class: "table-wrap" },
      h(
        "table",
        { class: "table webhooks-table" },
        h("caption", { class: "visually-hidden", text: "Webhook endpoints, newest first" }),
        h("thead", {}, h("tr", {}, ["Name", "URL", "Events", "Secret", "Created", "Actions"].map((t) => h("th", { scope: "col", text: t })))),
        tbody,
      ),
    ),
    empty,
    log,
  );
  focusHeading(main);

  function showError(err) {
    errorBox.textContent = err instanceof ApiError ? err.message : String(err);
    errorBox.hidden = false;
  }

  function showSecret(endpoint, what) {
    const code = h("code", { class: "secret", id: "webhook-secret", text: endpoint.signing_secret });
    const copy = h("button", { type: "button", class: "btn btn-small", text: "Copy" });
    copy.addEventListener("click", () => navigator.clipboard?.writeText(endpoint.signing_secret));
    secretBox.replaceChildren(
      h("p", {}, h("strong", { text: `${what} for ${endpoint.name}. ` }), "Copy it now: it is not shown again."),
      h("p", {}, code, " ", copy),
    );
    secretBox.hidden = false;
  }

  function renderTypes() {
    const checked = new Set([...typesBox.querySelectorAll("input:checked")].map((i) => i.value));
    typesBox.replaceChildren(
      h("legend", { text: "Events" }),
      ...state.types.map((t) =>
        h(
          "label",
          { class: "pick" },
          h("input", { type: "checkbox", name: "event_types", value: t, checked: checked.size ? checked.has(t) : true }),
          ` ${t}`,
        ),
      ),
    );
  }

  function renderEndpoints() {
    tbody.replaceChildren(
      ...state.endpoints.map((e) => {
        const deliveries = h("button", { type: "button", class: "btn btn-small", text: "Deliveries" });
        const rotate = h("button", { type: "button", class: "btn btn-small", text: "Rotate secret" });
        const remove = h("button", { type: "button", class: "btn btn-small btn-danger", text: "Delete" });
        deliveries.addEventListener("click", () => openLog(e));
        rotate.addEventListener("click", () => rotateSecret(e));
        remove.addEventListener("click", () => removeEndpoint(e));
        return h(
          "tr",
          { dataset: { endpoint: e.id } },
          h("td", { "data-label": "Name" }, h("span", { text: e.name }), h("div", { class: "muted", text: e.id })),
          h("td", { "data-label": "URL", class: "truncate", text: e.url }),
          h("td", { "data-label": "Events", text: e.event_types.join(", ") }),
          h("td", { "data-label": "Secret" }, h("code", { text: e.signing_secret_hint ?? "–" })),
          h("td", { "data-label": "Created", class: "nowrap", text: fmtTime(e.created_at) }),
          h("td", { "data-label": "Actions", class: "nowrap" }, deliveries, " ", rotate, " ", remove),
        );
      }),
    );
    empty.hidden = state.endpoints.length > 0;
  }

  async function refresh() {
    state.endpoints = await listAll("/webhook_endpoints");
    renderEndpoints();
    if (state.open && !state.endpoints.some((e) => e.id === state.open.id)) closeLog();
    if (state.open) await loadLog();
  }

  // A job's event links to its page; an eval run's id and an endpoint's test event are shown as they are (a
  // delivery does not carry the run's eval, which its page's address needs).
  function subjectCell(d) {
    if (d.subject_type === "fine_tuning.job") return h("a", { href: `#/jobs/${encodeURIComponent(d.subject_id)}`, text: d.subject_id });
    return h("span", { class: "mono", text: d.subject_type === "webhook_endpoint" ? "test event" : d.subject_id });
  }

  async function loadLog() {
    const endpoint = state.open;
    const page = await api(`/webhook_endpoints/${encodeURIComponent(endpoint.id)}/deliveries?limit=100`);
    if (state.open !== endpoint) return;
    const rows = page.data.map((d) =>
      h(
        "tr",
        { dataset: { delivery: d.id } },
        h("td", { "data-label": "Time", class: "nowrap", text: fmtTime(d.created_at) }),
        h("td", { "data-label": "Event", text: d.event_type }),
        h("td", { "data-label": "Subject" }, subjectCell(d)),
        h("td", { "data-label": "Attempt", class: "num", text: String(d.attempt) }),
        h("td", { "data-label": "Result" }, h("span", { class: `badge badge-${d.status === "delivered" ? "succeeded" : d.status === "failed" ? "failed" : "paused"}`, text: d.status })),
        h("td", { "data-label": "Answer", text: d.status_code !== null ? `HTTP ${d.status_code}` : d.error ?? "–" }),
        h("td", { "data-label": "Next retry", class: "nowrap", text: d.next_retry_at ? fmtTime(d.next_retry_at) : "–" }),
      ),
    );
    log.replaceChildren(
      h("h2", { id: "deliveries-title", text: `Deliveries to ${endpoint.name}` }),
      rows.length
        ? h(
            "div",
            { class: "table-wrap" },
            h(
              "table",
              { class: "table deliveries-table" },
              h("thead", {}, h("tr", {}, ["Time", "Event", "Subject", "Attempt", "Result", "Answer", "Next retry"].map((t) => h("th", { scope: "col", text: t })))),
              h("tbody", {}, rows),
            ),
          )
        : h("p", { class: "empty", text: "No delivery attempts yet." }),
    );
    log.hidden = false;
  }

  async function openLog(endpoint) {
    state.open = endpoint;
    try {
      await loadLog();
      log.querySelector("h2")?.scrollIntoView({ block: "nearest" });
    } catch (err) {
      showError(err);
    }
  }

  function closeLog() {
    state.open = null;
    log.hidden = true;
    log.replaceChildren();
  }

  async function rotateSecret(endpoint) {
    if (!window.confirm(`Rotate the signing secret of ${endpoint.name}? Deliveries are signed with the new one at once.`)) return;
    try {
      const rotated = await api(`/webhook_endpoints/${encodeURIComponent(endpoint.id)}/rotate_secret`, { method: "POST", json: {} });
      showSecret(rotated, "New secret");
      await refresh();
    } catch (err) {
      showError(err);
    }
  }

  async function removeEndpoint(endpoint) {
    if (!window.confirm(`Delete ${endpoint.name}? Deliveries still owed to it are dropped.`)) return;
    try {
      await api(`/webhook_endpoints/${encodeURIComponent(endpoint.id)}`, { method: "DELETE" });
      await refresh();
    } catch (err) {
      showError(err);
    }
  }

  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    errorBox.hidden = true;
    for (const p of Object.values(fieldErrors)) p.textContent = "";
    const body = {
      name: nameInput.value.trim(),
      url: urlInput.value.trim(),
      event_types: [...typesBox.querySelectorAll("input:checked")].map((i) => i.value),
    };
    submit.disabled = true;
    try {
      const made = await api("/webhook_endpoints", { method: "POST", json: body });
      showSecret(made, "Signing secret");
      form.reset();
      renderTypes();
      await refresh();
    } catch (err) {
      const field = err instanceof ApiError ? fieldErrors[err.param] : null;
      if (field) field.textContent = err.message;
      else showError(err);
    } finally {
      submit.disabled = false;
    }
  });

  api("/webhook_event_types")
    .then((types) => {
      state.types = types.data;
      renderTypes();
    })
    .catch(showError);
  const timer = poller(refresh, REFRESH_MS);
  return () => timer.stop();
}
