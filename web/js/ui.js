// Small DOM and formatting helpers shared by the pages.

/** h("div#id.card", {onclick}, child, ...): an element; strings become text nodes. */
export function h(spec, attrs = {}, ...children) {
  const el = document.createElement(spec.match(/^[^.#]*/)[0] || "div");
  const id = spec.match(/#([^.#]+)/);
  if (id) el.id = id[1];
  const classes = [...spec.matchAll(/\.([^.#]+)/g)].map((m) => m[1]);
  if (classes.length) el.className = classes.join(" ");
  if (attrs === null || typeof attrs !== "object" || attrs instanceof Node || Array.isArray(attrs)) {
    children.unshift(attrs);
    attrs = {};
  }
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else if (key === "class") el.className += (el.className ? " " : "") + value;
    else if (key === "dataset") Object.assign(el.dataset, value);
    // Through the CSSOM: the CSP (style-src 'self') refuses inline style attributes.
    else if (key === "style") el.style.cssText = value;
    else if (key in el && typeof value !== "string") el[key] = value;
    else el.setAttribute(key, value === true ? "" : value);
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

export function clear(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

const UNITS = ["B", "KB", "MB", "GB", "TB"];

/** Decimal units with one decimal at most, as the server writes them (omlx/sizes.py). */
export function formatBytes(bytes) {
  if (bytes === null || bytes === undefined || Number.isNaN(bytes)) return "–";
  let value = Math.abs(Number(bytes));
  let unit = 0;
  while (Math.round(value * 10) / 10 >= 1000 && unit < UNITS.length - 1) {
    value /= 1000;
    unit += 1;
  }
  const text = value.toFixed(1).replace(/\.0$/, "");
  return `${bytes < 0 ? "-" : ""}${text} ${UNITS[unit]}`;
}

export function formatDuration(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return "–";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${String(s % 60).padStart(2, "0")}s`;
  const hours = Math.floor(s / 3600);
  if (hours < 48) return `${hours}h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
  return `${Math.floor(hours / 24)}d ${hours % 24}h`;
}

export function formatNumber(value, digits = 0) {
  if (value === null || value === undefined || !Number.isFinite(Number(value))) return "–";
  return Number(value).toLocaleString(undefined, {
    minimumFractionDigits: digits,
    maximumFractionDigits: digits,
  });
}

export function formatPercent(fraction) {
  if (fraction === null || fraction === undefined || !Number.isFinite(fraction)) return "–";
  return `${(fraction * 100).toFixed(1)}%`;
}

// ``reason``: why a failed load failed (shown on hover).
export function stateBadge(state, reason = null) {
  const kind = { loaded: "ok", pinned: "accent", loading: "warn", failed: "err", unloaded: "" }[state] ?? "";
  return h(`span.badge${kind ? "." + kind : ""}`, { dataset: { state }, title: reason }, state);
}

export function toast(message, kind = "") {
  const box = document.getElementById("toasts");
  const el = h(`div.toast${kind ? "." + kind : ""}`, { role: "status" }, message);
  box.append(el);
  setTimeout(() => el.remove(), kind === "err" ? 8000 : 4000);
}

/** A modal <dialog> with a form; resolves with onSubmit's result, or null when cancelled.
 * onSubmit may throw to keep the dialog open (it shows its own errors). */
export function openDialog({ title, body, submitLabel = "Save", onSubmit, extraButtons = [] }) {
  return new Promise((resolve) => {
    const submit = h("button.btn.primary", { type: "submit" }, submitLabel);
    const cancel = h("button.btn", { type: "button", onclick: () => close(null) }, "Cancel");
    const form = h(
      "form",
      { method: "dialog", novalidate: true },
      h("div.dialog-head", h("h2", title)),
      h("div.dialog-body", body),
      h("div.dialog-foot", extraButtons, h("span.spacer"), cancel, submit),
    );
    const dialog = h("dialog", form);
    let done = false;
    const close = (value) => {
      if (done) return;
      done = true;
      dialog.close();
      dialog.remove();
      resolve(value);
    };
    dialog.addEventListener("cancel", () => close(null));
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      submit.disabled = true;
      try {
        close(await onSubmit(form));
      } catch (_) {
        // onSubmit showed the problem next to its fields; keep the dialog open.
      } finally {
        submit.disabled = false;
      }
    });
    document.body.append(dialog);
    dialog.showModal();
  });
}

/** A labelled form field; returns {el, input, setError}. */
export function field({ label, input, help, name }) {
  const error = h("div.error", { hidden: true, dataset: { errorFor: name ?? "" } });
  const isCheck = input.type === "checkbox";
  const el = isCheck
    ? h("div.field.check", h("label", { for: input.id }, input, label), help && h("div.help", help), error)
    : h("div.field", h("label", { for: input.id }, label), input, help && h("div.help", help), error);
  if (name) el.dataset.field = name;
  const setError = (message) => {
    el.classList.toggle("invalid", Boolean(message));
    error.hidden = !message;
    error.textContent = message || "";
  };
  return { el, input, setError };
}

let nextId = 0;
export function uid(prefix = "f") {
  nextId += 1;
  return `${prefix}-${nextId}`;
}

const ICON_PATHS = {
  dashboard: "M3 13h8V3H3zm0 8h8v-6H3zm10 0h8V11h-8zm0-18v6h8V3z",
  models: "M12 2 2 7l10 5 10-5zm-10 10 10 5 10-5M2 17l10 5 10-5",
  download: "M12 3v12m-5-5 5 5 5-5M4 19h16",
  settings:
    "M12 15a3 3 0 1 0 0-6 3 3 0 0 0 0 6zm7.4-3a7.4 7.4 0 0 0-.1-1.2l2-1.6-2-3.4-2.4 1a7 7 0 0 0-2-1.2L14.5 3h-5l-.4 2.6a7 7 0 0 0-2 1.2l-2.4-1-2 3.4 2 1.6a7.4 7.4 0 0 0 0 2.4l-2 1.6 2 3.4 2.4-1a7 7 0 0 0 2 1.2l.4 2.6h5l.4-2.6a7 7 0 0 0 2-1.2l2.4 1 2-3.4-2-1.6c.1-.4.1-.8.1-1.2z",
  quant: "M4 20h4V10H4zm6 0h4V4h-4zm6 0h4v-7h-4z",
  chat: "M21 12a8 8 0 0 1-11.6 7.1L4 20l1-4.6A8 8 0 1 1 21 12z",
  logs: "M4 5h16M4 10h16M4 15h10M4 20h7",
  bench: "M12 13l4-4M5.6 19a9 9 0 1 1 12.8 0",
  connect: "M9 15l6-6M10 6l1.5-1.5a4 4 0 0 1 5.7 5.7L15.7 11.7M14 18l-1.5 1.5a4 4 0 0 1-5.7-5.7l1.5-1.5",
  sun: "M12 17a5 5 0 1 0 0-10 5 5 0 0 0 0 10zM12 1v2m0 18v2M4.2 4.2l1.4 1.4m12.8 12.8 1.4 1.4M1 12h2m18 0h2M4.2 19.8l1.4-1.4M18.4 5.6l1.4-1.4",
  moon: "M21 12.8A9 9 0 1 1 11.2 3a7 7 0 0 0 9.8 9.8z",
  cluster: "M4 4h6v6H4zm10 0h6v6h-6zM4 14h6v6H4zm10 0h6v6h-6zM10 7h4M7 10v4m10-4v4m-7 3h4",
};

export function icon(name) {
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("viewBox", "0 0 24 24");
  svg.setAttribute("fill", "none");
  svg.setAttribute("stroke", "currentColor");
  svg.setAttribute("stroke-width", "1.8");
  svg.setAttribute("stroke-linecap", "round");
  svg.setAttribute("stroke-linejoin", "round");
  svg.setAttribute("aria-hidden", "true");
  const path = document.createElementNS("http://www.w3.org/2000/svg", "path");
  path.setAttribute("d", ICON_PATHS[name] ?? "");
  svg.append(path);
  return svg;
}
