// Sign-in: an API key, checked against the API before it is kept (in this browser's localStorage).

import { api, setKey } from "../api.js";
import { focusHeading, h } from "../dom.js";

export function mountSignIn(main, { notice, onSignedIn }) {
  document.title = "Sign in · Proxima";
  const input = h("input", {
    id: "api-key",
    name: "api-key",
    type: "password",
    autocomplete: "current-password",
    spellcheck: "false",
    required: true,
    "aria-describedby": "api-key-help api-key-error",
  });
  const error = h("p", { id: "api-key-error", class: "field-error", role: "alert" });
  const button = h("button", { type: "submit", class: "btn btn-primary", text: "Sign in" });
  const form = h(
    "form",
    { class: "card signin", novalidate: true },
    h("h1", { text: "Sign in" }),
    notice ? h("p", { class: "notice", text: notice }) : null,
    h("label", { for: "api-key", text: "API key" }),
    input,
    error,
    h(
      "p",
      { id: "api-key-help", class: "help" },
      "Create one on the server with ",
      h("code", { text: "proxima keys create --tenant NAME" }),
      "; on the embedded default it is in ",
      h("code", { text: "~/.proxima/local_api_key" }),
      ". The key is kept in this browser until you sign out.",
    ),
    button,
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const key = input.value.trim();
    error.textContent = "";
    input.removeAttribute("aria-invalid");
    if (!key) {
      error.textContent = "Enter an API key.";
      input.setAttribute("aria-invalid", "true");
      input.focus();
      return;
    }
    button.disabled = true;
    try {
      await api("/models", { key });
      setKey(key);
      onSignedIn();
    } catch (err) {
      error.textContent = err.status === 401 ? `This key was refused: ${err.message}` : err.message;
      input.setAttribute("aria-invalid", "true");
      input.focus();
    } finally {
      button.disabled = false;
    }
  });
  main.append(form);
  focusHeading(main);
  input.focus();
  return () => {};
}
