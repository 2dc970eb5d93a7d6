// The REST API as the dashboard uses it: the signed-in key on every request, errors as ApiError (OpenAI's
// envelope {"error": {message, type, param, code}}), downloads through fetch → blob → an anchor with `download`
// (a plain link could not send the Authorization header).

const KEY_STORAGE = "proxima.apiKey";
// The API is at /v1 next to /dashboard/, also behind a proxy that serves both under a prefix.
const BASE = new URL("../v1", document.baseURI).pathname;

export function getKey() {
  return localStorage.getItem(KEY_STORAGE);
}

export function setKey(key) {
  localStorage.setItem(KEY_STORAGE, key);
}

export function clearKey() {
  localStorage.removeItem(KEY_STORAGE);
}

export class ApiError extends Error {
  constructor(status, error) {
    super(error.message || `HTTP ${status}`);
    this.status = status;
    this.type = error.type ?? null;
    this.param = error.param ?? null;
    this.code = error.code ?? null;
  }
}

async function errorOf(response) {
  try {
    const body = await response.json();
    if (body && typeof body.error === "object" && body.error !== null) return new ApiError(response.status, body.error);
  } catch {
    // not JSON: a proxy's error page
  }
  return new ApiError(response.status, { message: `${response.status} ${response.statusText}`.trim() });
}

/** Call the API; resolves to the parsed JSON body (or the Response with `raw`), rejects with ApiError. A 401
 * signs the user out everywhere (the key was revoked or never worked). */
export async function api(path, { method = "GET", json, form, signal, raw = false, key = getKey() } = {}) {
  const headers = { Authorization: `Bearer ${key ?? ""}` };
  let body;
  if (json !== undefined) {
    headers["Content-Type"] = "application/json";
    body = JSON.stringify(json);
  } else if (form !== undefined) {
    body = form; // the browser sets the multipart boundary
  }
  let response;
  try {
    response = await fetch(BASE + path, { method, headers, body, signal, cache: "no-store" });
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError(0, { message: "The server cannot be reached.", code: "network_error" });
  }
  if (!response.ok) {
    const error = await errorOf(response);
    if (response.status === 401 && key === getKey()) {
      window.dispatchEvent(new CustomEvent("proxima:unauthorized", { detail: error.message }));
    }
    throw error;
  }
  return raw ? response : response.json();
}

/** Every page of a list endpoint that pages with `after` (up to `max` items). */
export async function listAll(path, { limit = 100, max = 1000, signal } = {}) {
  const items = [];
  let after = null;
  for (;;) {
    const sep = path.includes("?") ? "&" : "?";
    const page = await api(`${path}${sep}limit=${limit}${after ? `&after=${encodeURIComponent(after)}` : ""}`, {
      signal,
    });
    items.push(...page.data);
    if (!page.has_more || page.data.length === 0 || items.length >= max) return items;
    after = page.data[page.data.length - 1].id;
  }
}

function filenameOf(response, fallback) {
  const header = response.headers.get("content-disposition") || "";
  const star = /filename\*=UTF-8''([^;]+)/i.exec(header);
  if (star) {
    try {
      return decodeURIComponent(star[1]);
    } catch {
      // a malformed header: fall through
    }
  }
  const plain = /filename="([^"]+)"/i.exec(header);
  return plain ? plain[1] : fallback;
}

/** Download an authenticated file as the browser's own download (the server's file name). */
export async function download(path, fallbackName) {
  const response = await api(path, { raw: true });
  const blob = await response.blob();
  const url = URL.createObjectURL(blob);
  const a = document.createElement("a");
  a.href = url;
  a.download = filenameOf(response, fallbackName);
  a.hidden = true;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 60_000);
  return a.download;
}
