// Settings: every global setting grouped, validated by the server with the error
// shown next to its field, and marked when it needs a restart. Security settings the
// server will not change for this session are shown read-only with the reason.

import { get, post, put } from "../api.js";
import { clear, field, formatBytes, h, icon, toast, uid } from "../ui.js";

const SIZE_HELP = "A size (24GB, 512MB), NN% of RAM";
// [title, [[group, field, type, help, options]]]; types: text, number, bool, select, list,
// map (comma-separated key=value pairs), size, secret.
const GROUPS = [
  ["Server", [
    ["server", "host", "text", "Address to listen on; beyond loopback needs an API key."],
    ["server", "port", "number"],
    ["server", "log_level", "select", null, ["debug", "info", "warning", "error"]],
    ["server", "cors_origins", "list", "Comma-separated origins allowed to call the API from a browser."],
    ["server", "allowed_hosts", "list", "Comma-separated extra host names the server answers to (e.g. a proxy's name)."],
    ["server", "sse_keepalive_s", "number", "Seconds between keep-alive comments during a long prefill."],
    ["server", "template_timeout_s", "number", "Seconds a chat template may take to render before its request is refused."],
    ["server", "web_dir", "path", "Folder of this admin panel; empty: the bundled one."],
  ]],
  ["Authentication", [
    ["server", "api_key", "secret", "Leave empty to keep the current key. Changing it ends every session."],
    ["server", "allow_unauthenticated_remote", "bool", "Allow a non-loopback host without a key."],
  ]],
  ["Models", [
    ["models", "model_dirs", "list", "Comma-separated folders to scan; empty: <base>/models."],
    ["models", "default_model", "text", "Used when a request names \"default\"."],
    ["models", "install_default_model", "bool", "Install the built-in model when none is found at start."],
    ["models", "idle_timeout_s", "number", "Unload a model idle this many seconds; empty: never."],
    ["models", "anthropic_aliases", "map", "Anthropic model names (Claude Code's claude-sonnet-4-5...) to serve with a local model: comma-separated pattern=model pairs; an empty model means the default one, e.g. claude-*="],
    ["models", "load_at_start", "bool", "Load the pinned and default models in the background at start."],
    ["models", "hf_endpoint", "text", "Hugging Face Hub address for downloads (a mirror); empty: HF_ENDPOINT or huggingface.co."],
    ["models", "hf_token", "secret", "Token for gated or private repos. Leave empty to keep the current one."],
    ["models", "image_url_allowlist", "list", "Comma-separated hosts (globs such as *.example.org) whose http(s) image URLs chat requests may have the server fetch; empty: none (images come inline as data URLs)."],
  ]],
  ["Scheduler", [
    ["scheduler", "max_concurrent_requests", "number"],
    ["scheduler", "max_queued_requests", "number", "Beyond this, requests get 503 with Retry-After."],
    ["scheduler", "prefill_step_size", "number", "Prompt tokens per prefill chunk."],
  ]],
  ["Sampling defaults", [
    ["sampling", "temperature", "number"],
    ["sampling", "top_p", "number"],
    ["sampling", "top_k", "number"],
    ["sampling", "min_p", "number"],
    ["sampling", "repetition_penalty", "number"],
  ]],
  ["Generation", [
    ["generation", "max_context_window", "number"],
    ["generation", "max_tokens", "number", "When a request does not say max_tokens."],
  ]],
  ["Memory", [
    ["memory", "max_process_memory", "size", `The hard ceiling: auto, ${SIZE_HELP}.`],
    ["memory", "soft_fraction", "number", "Soft limit as a fraction of the hard one."],
    ["memory", "prefill_transient_margin", "size", "Room for transients no estimate models."],
    ["memory", "poll_interval_s", "number"],
    ["memory", "max_model_memory", "size", "Budget for loaded weights: auto (the hard limit) or a size."],
    ["memory", "max_kv_tokens", "number", "KV tokens a model may hold; empty: measured at load (auto-profile)."],
  ]],
  ["Cache", [
    ["cache", "enabled", "bool"],
    ["cache", "block_size", "number", "Tokens per block."],
    ["cache", "hot_cache_max_size", "size", `RAM tier: ${SIZE_HELP}.`],
    ["cache", "hot_cache_mode", "select", null, ["write-back", "write-through", "hot-only"]],
    ["cache", "ssd_cache_dir", "path", "Empty: <base>/cache."],
    ["cache", "ssd_cache_max_size", "size", "auto or a size."],
    ["cache", "ssd_auto_fraction", "number"],
  ]],
  ["Desktop app", [
    ["app", "update_feed", "text", "Release feed the app checks daily for updates; empty: the project's releases (the feed the app was built with); off: never check."],
  ]],
];

function toInput(type, value) {
  if (type === "list") return (value ?? []).join(", ");
  if (type === "map") return Object.entries(value ?? {}).map(([k, v]) => `${k}=${v ?? ""}`).join(", ");
  if (type === "secret") return "";
  return value === null || value === undefined ? "" : String(value);
}

function fromInput(type, input) {
  const raw = input.type === "checkbox" ? input.checked : input.value.trim();
  if (type === "bool") return raw;
  if (type === "list") return raw ? raw.split(",").map((s) => s.trim()).filter(Boolean) : [];
  if (type === "map") return mapFromInput(raw);
  if (type === "number") return raw === "" ? null : Number(raw);
  if (type === "size") return /^\d+$/.test(raw) ? Number(raw) : raw;
  return raw === "" ? null : raw;
}

/** "claude-*=, gpt-*=qwen3" -> {"claude-*": null, "gpt-*": "qwen3"}; the server checks it. */
function mapFromInput(raw) {
  const out = {};
  for (const pair of raw.split(",").map((s) => s.trim()).filter(Boolean)) {
    const at = pair.indexOf("=");
    const key = (at < 0 ? pair : pair.slice(0, at)).trim();
    const value = at < 0 ? "" : pair.slice(at + 1).trim();
    out[key] = value || null;
  }
  return out;
}

function makeInput(group, name, type, value, options) {
  const id = uid("set");
  const attrs = { id, name: `${group}.${name}` };
  if (type === "bool") return h("input", { ...attrs, type: "checkbox", checked: Boolean(value) });
  if (type === "select") return h("select", attrs, options.map((o) => h("option", { value: o, selected: o === value }, o)));
  if (type === "secret") return h("input", { ...attrs, type: "password", autocomplete: "new-password", placeholder: value ? "•••••• (set)" : "(none)" });
  return h("input", { ...attrs, type: type === "number" ? "number" : "text", step: type === "number" ? "any" : undefined, value: toInput(type, value) });
}

const LOCK_PATH = "M7 11V7a5 5 0 0 1 10 0v4M5 11h14v10H5z";

function lockIcon() {
  const svg = icon("");
  svg.querySelector("path").setAttribute("d", LOCK_PATH);
  return svg;
}

/** Show a field the server will not change for this session read-only, with why. */
function lockField(f, reason) {
  f.input.disabled = true;
  f.el.classList.add("locked");
  f.el.title = reason;
  f.el.querySelector("label").append(h("span.badge.warn.locked", { title: reason }, lockIcon(), "read-only"));
  f.el.querySelector(".error").before(h("div.help.locked-note", reason));
}

/** Field keys named in a settings error ("invalid setting 'memory.soft_fraction': ..."). */
function erroredKeys(error, known) {
  const keys = new Set();
  if (error.param) keys.add(error.param);
  for (const match of error.message.matchAll(/setting '([^']+)'/g)) keys.add(match[1]);
  return [...keys].map((k) => known.find((key) => k === key || k.startsWith(key + "."))).filter(Boolean);
}

function memoryPreview(fields) {
  const out = h("div.notice", { id: "memory-preview" }, "…");
  let timer = null;
  const update = () => {
    clearTimeout(timer);
    timer = setTimeout(async () => {
      const body = {};
      for (const name of ["max_process_memory", "soft_fraction", "prefill_transient_margin", "max_model_memory"]) {
        const f = fields[`memory.${name}`];
        body[name] = fromInput(f.type, f.input);
      }
      try {
        const p = await post("/memory/preview", body);
        out.className = "notice ok";
        out.textContent = `Resulting ceiling: hard ${formatBytes(p.hard_bytes)}, soft ${formatBytes(p.soft_bytes)}, weights budget ${formatBytes(p.model_budget_bytes)} (RAM ${formatBytes(p.total_ram_bytes)}).`;
      } catch (error) {
        out.className = "notice err";
        out.textContent = error.message;
      }
    }, 250);
  };
  for (const name of ["max_process_memory", "soft_fraction", "prefill_transient_margin", "max_model_memory"]) {
    fields[`memory.${name}`].input.addEventListener("input", update);
  }
  update();
  return out;
}

export async function render(view) {
  const data = await get("/settings");
  const live = new Set(data.live);
  const locked = data.locked ?? {};
  const fields = {};
  const cards = GROUPS.map(([title, specs]) => {
    const items = specs.map(([group, name, type, help, options]) => {
      const key = `${group}.${name}`;
      const value = data.settings[group][name];
      const input = makeInput(group, name, type, value, options);
      const f = field({ label: name, input, help, name: key });
      const mark = h("span.badge.restart", { hidden: true }, "restart needed");
      const label = f.el.querySelector("label");
      if (live.has(key)) label.append(h("span.badge.ok", { title: "Applies at once" }, "live"));
      label.append(mark);
      if (locked[key]) lockField(f, locked[key]);
      fields[key] = { ...f, type, locked: Boolean(locked[key]), original: JSON.stringify(type === "secret" ? null : fromInput(type, input)), mark };
      return f.el;
    });
    return h("section.card.settings-group", { dataset: { group: title.toLowerCase() } }, h("div.card-head", h("h2", title)), h("div.fields", items));
  });
  const memoryCard = cards.find((c) => c.dataset.group === "memory");
  memoryCard.insertBefore(memoryPreview(fields), memoryCard.querySelector(".fields"));
  const result = h("div.notice", { hidden: true, id: "settings-result" });
  const save = h("button.btn.primary", { type: "submit" }, "Save changes");
  const lockedNote = Object.keys(locked).length ? h("div.notice.warn", { id: "settings-locked" }, data.protected_reason) : null;
  const form = h("form.stack", { novalidate: true }, h("p.muted.small", `Saved to ${data.path}. Fields marked live apply at once; the others at the next start.`), lockedNote, cards, h("div.settings-actions", save, result));
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const changes = {};
    for (const [key, f] of Object.entries(fields)) {
      f.setError("");
      if (f.locked) continue;
      const value = fromInput(f.type, f.input);
      if (f.type === "secret" ? value === null : JSON.stringify(value) === f.original) continue;
      const [group, name] = key.split(".");
      (changes[group] ??= {})[name] = value;
    }
    result.hidden = false;
    if (!Object.keys(changes).length) {
      result.className = "notice";
      result.textContent = "Nothing changed.";
      return;
    }
    save.disabled = true;
    try {
      const saved = await put("/settings", changes);
      for (const key of saved.restart_required) fields[key].mark.hidden = false;
      for (const [key, f] of Object.entries(fields)) {
        if (f.type !== "secret") f.original = JSON.stringify(fromInput(f.type, f.input));
        else f.input.value = "";
      }
      result.className = saved.restart_required.length ? "notice warn" : "notice ok";
      result.textContent = saved.restart_required.length
        ? `Saved. Restart the server for: ${saved.restart_required.join(", ")}.`
        : "Saved and applied.";
      toast("Settings saved", "ok");
    } catch (error) {
      const keys = erroredKeys(error, Object.keys(fields));
      keys.forEach((k) => fields[k].setError(error.message.replace(/ \[flag, .*?\]/g, "")));
      if (keys.length) fields[keys[0]].input.focus();
      result.className = "notice err";
      result.textContent = keys.length ? "Not saved: fix the marked field." : `Not saved: ${error.message}`;
    } finally {
      save.disabled = false;
    }
  });
  clear(view, form);
}
