// The server's HTTP API: JSON calls with the error envelope turned into ApiError.

export class ApiError extends Error {
  constructor(status, error) {
    super(error?.message || `HTTP ${status}`);
    this.status = status;
    this.param = error?.param ?? null;
    this.code = error?.code ?? null;
    this.type = error?.type ?? null;
  }
}

async function errorOf(response) {
  let body = null;
  try {
    body = await response.json();
  } catch (_) {
    /* not JSON: keep the status line */
  }
  const error = body?.error ?? (body?.detail ? { message: String(body.detail) } : null);
  return new ApiError(response.status, error ?? { message: `${response.status} ${response.statusText}` });
}

/** Fire when the admin API says a login is needed; app.js shows the login page. */
function loginRequired() {
  window.dispatchEvent(new CustomEvent("omlx:login-required"));
}

/** Sent on every call: the server refuses state changes without it (or a JSON body),
 * which a cross-site form or no-cors fetch cannot send. */
export const CLIENT_HEADERS = { "X-Omlx-Client": "admin" };

export async function request(path, { method = "GET", body, signal, headers = {} } = {}) {
  // The login session cookie authorizes both the admin API and /v1: no key is kept in the page.
  const init = { method, signal, headers: { ...CLIENT_HEADERS, ...headers }, credentials: "same-origin" };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const response = await fetch(path, init);
  if (!response.ok) {
    const error = await errorOf(response);
    if (error.code === "admin_login_required") loginRequired();
    throw error;
  }
  return response.status === 204 ? null : response.json();
}

export const admin = (path, options) => request(`/admin/api${path}`, options);
export const get = (path) => admin(path);
export const post = (path, body = {}) => admin(path, { method: "POST", body });
export const put = (path, body) => admin(path, { method: "PUT", body });
export const del = (path) => admin(path, { method: "DELETE" });

export const encodeName = (name) => name.split("/").map(encodeURIComponent).join("/");

/** Stream a chat completion: calls onChunk(parsed JSON) per SSE event; resolves at [DONE].
 * Aborting ``signal`` stops the request (the server then aborts the generation). */
export async function streamChat(body, { signal, onChunk }) {
  const response = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: { ...CLIENT_HEADERS, "Content-Type": "application/json" },
    credentials: "same-origin",
    body: JSON.stringify({ ...body, stream: true }),
    signal,
  });
  if (!response.ok) throw await errorOf(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue; // ": keep-alive" comments and the like
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new ApiError(500, chunk.error);
        onChunk(chunk);
      }
    }
  }
}
