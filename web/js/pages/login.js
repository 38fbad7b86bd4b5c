// Login: exchanges the API key for a session cookie (and keeps the key for /v1 calls).

import { ApiError, post } from "../api.js";
import { field, h, uid } from "../ui.js";

export function render(view, { params, navigate }) {
  const input = h("input", { id: uid(), type: "password", name: "api_key", autocomplete: "current-password", required: true });
  const key = field({ label: "API key", input, name: "api_key", help: "The server's server.api_key." });
  const submit = h("button.btn.primary", { type: "submit" }, "Log in");
  const form = h(
    "form.stack",
    { novalidate: true },
    h("div", h("h2", "Log in to omlx"), h("p.muted", "This server is protected by an API key.")),
    key.el,
    submit,
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    key.setError("");
    if (!input.value) return key.setError("Enter the API key.");
    submit.disabled = true;
    try {
      await post("/login", { api_key: input.value });
      window.dispatchEvent(new CustomEvent("omlx:logged-in"));
      const next = params.get("next");
      if (next && !next.startsWith("login")) location.hash = `#/${next}`;
      else navigate("dashboard");
    } catch (error) {
      key.setError(error instanceof ApiError && error.status === 401 ? "That key is not right." : error.message);
    } finally {
      submit.disabled = false;
    }
  });
  view.append(h("div.login", h("div.card", form)));
  input.focus();
}
