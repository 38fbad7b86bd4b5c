// Models: every discovered model; load, unload, pin, per-model settings, GGUF import.

import { ApiError, del, encodeName, get, post, put } from "../api.js";
import { clear, field, formatBytes, formatDuration, h, openDialog, stateBadge, toast, uid } from "../ui.js";

const POLL_MS = 3000;

// Every per-model field (omlx/models/model_settings.py), in dialog order.
const FIELDS = [
  { name: "alias", label: "Alias", type: "text", help: "Name clients may use instead of the folder name." },
  { name: "model_type", label: "Model type", type: "select", options: ["", "llm", "vlm", "embedding", "rerank"], help: "Empty: as detected. rerank: an LLM reranker (Qwen3-Reranker style) whose folder name does not say reranker." },
  { name: "is_default", label: "Default model", type: "checkbox", help: "Answers the model name \"default\"." },
  { name: "pinned", label: "Pinned", type: "checkbox", help: "Never evicted or expired while loaded." },
  { name: "ttl_s", label: "Idle TTL (s)", type: "number", step: "any", help: "Unload after this many idle seconds; empty: global idle timeout." },
  { name: "max_context_window", label: "Max context window", type: "number", step: "1" },
  { name: "max_tokens", label: "Default max tokens", type: "number", step: "1" },
  { name: "strict_max_tokens", label: "Strict max tokens", type: "checkbox", help: "Refuse a max_tokens larger than the room the prompt leaves, instead of clamping it to that room." },
  { name: "max_kv_tokens", label: "Max KV tokens", type: "number", step: "1", help: "Pins the KV capacity; empty: measured at load." },
  { name: "kv_bits", label: "KV cache bits", type: "number", step: "4", help: "4 or 8: quantize the KV cache (about half or a quarter of its memory; no speculative decoding); empty: full precision. Applied at the next load." },
  { name: "quantized_kv_start", label: "Quantize KV after (tokens)", type: "number", step: "1", help: "With KV cache bits: a request's KV stays full precision until it holds this many tokens, then all of it is quantized (mlx-lm's quantized_kv_start); empty or 0: from the first token. Applied at the next load." },
  { name: "kv_group_size", label: "KV quantization group", type: "number", step: "32", help: "32, 64 or 128 values per group; empty: 32 (64: fewer bytes on bf16 models, a little more drift)." },
  { name: "trust_remote_code", label: "Trust remote code", type: "checkbox", help: "Let loading run Python code the model folder ships (an auto_map's tokenization_*.py, a model_file). Off: such a model is refused. Only for folders you trust. Applied at the next load." },
  { name: "temperature", label: "Temperature", type: "number", step: "any" },
  { name: "top_p", label: "Top p", type: "number", step: "any" },
  { name: "top_k", label: "Top k", type: "number", step: "1" },
  { name: "min_p", label: "Min p", type: "number", step: "any" },
  { name: "repetition_penalty", label: "Repetition penalty", type: "number", step: "any" },
  { name: "force_sampling", label: "Force sampling", type: "checkbox", help: "The model's sampling values win over the request's." },
  { name: "chat_template_kwargs", label: "Chat template kwargs (JSON)", type: "json", help: 'e.g. {"enable_thinking": false}' },
  { name: "locked_template_kwargs", label: "Locked template kwargs", type: "list", help: "Comma-separated keys a request may not override." },
];

function makeInput(spec, value) {
  const id = uid("ms");
  if (spec.type === "checkbox") return h("input", { id, name: spec.name, type: "checkbox", checked: Boolean(value) });
  if (spec.type === "select") {
    return h("select", { id, name: spec.name }, spec.options.map((o) => h("option", { value: o, selected: (value ?? "") === o }, o || "(detected)")));
  }
  if (spec.type === "json") return h("textarea", { id, name: spec.name, rows: 3 }, value && Object.keys(value).length ? JSON.stringify(value, null, 2) : "");
  const shown = spec.type === "list" ? (value ?? []).join(", ") : value ?? "";
  return h("input", { id, name: spec.name, type: spec.type === "number" ? "number" : "text", step: spec.step, value: String(shown) });
}

/** The form's values as the PUT body; a field it cannot parse throws {field, message}. */
function readForm(inputs) {
  const out = {};
  for (const spec of FIELDS) {
    const input = inputs[spec.name];
    const raw = input.type === "checkbox" ? input.checked : input.value.trim();
    if (spec.type === "checkbox") out[spec.name] = raw;
    else if (spec.type === "number") out[spec.name] = raw === "" ? null : Number(raw);
    else if (spec.type === "list") out[spec.name] = raw ? raw.split(",").map((s) => s.trim()).filter(Boolean) : [];
    else if (spec.type === "json") {
      try {
        out[spec.name] = raw ? JSON.parse(raw) : {};
      } catch (_) {
        throw { field: spec.name, message: "not valid JSON" };
      }
    } else out[spec.name] = raw === "" ? null : raw;
  }
  return out;
}

async function settingsDialog(model, refresh) {
  const { settings } = await get(`/models/${encodeName(model.name)}/settings`);
  const inputs = {};
  const fields = {};
  for (const spec of FIELDS) {
    inputs[spec.name] = makeInput(spec, settings[spec.name]);
    fields[spec.name] = field({ label: spec.label, input: inputs[spec.name], help: spec.help, name: spec.name });
  }
  const general = h("div.notice.err", { hidden: true });
  const reset = h("button.btn.danger", {
    type: "button",
    onclick: async () => {
      await del(`/models/${encodeName(model.name)}/settings`);
      toast(`Settings of ${model.name} reset`, "ok");
      document.querySelector("dialog")?.dispatchEvent(new Event("cancel"));
      refresh();
    },
  }, "Reset to defaults");
  await openDialog({
    title: `Settings · ${model.name}`,
    body: h("div.stack", general, h("div.fields", FIELDS.map((s) => fields[s.name].el))),
    extraButtons: [reset],
    onSubmit: async () => {
      Object.values(fields).forEach((f) => f.setError(""));
      general.hidden = true;
      try {
        const body = readForm(inputs);
        await put(`/models/${encodeName(model.name)}/settings`, body);
      } catch (error) {
        const name = error.field ?? error.param;
        if (name && fields[name]) fields[name].setError(error.message);
        else {
          general.hidden = false;
          general.textContent = error.message;
        }
        throw error;
      }
      toast(`Saved settings of ${model.name}`, "ok");
      refresh();
      return true;
    },
  });
}

async function importDialog(refresh) {
  const path = h("input", { id: uid(), name: "path", placeholder: "/path/to/model.gguf" });
  const name = h("input", { id: uid(), name: "name", placeholder: "(file name)" });
  const dtype = h("select", { id: uid(), name: "dtype" }, ["", "float32", "float16", "keep"].map((d) => h("option", { value: d }, d || "automatic")));
  const fields = {
    path: field({ label: "GGUF file on the server", input: path, name: "path", help: "llama architecture; Q4_0, Q4_1, Q8_0, F16 or F32 tensors." }),
    name: field({ label: "Model name", input: name, name: "name" }),
    dtype: field({ label: "Weights", input: dtype, name: "dtype", help: "keep: stay quantized (fast on Metal); float32 on CPU." }),
  };
  const general = h("div.notice.err", { hidden: true });
  await openDialog({
    title: "Import a GGUF",
    submitLabel: "Import",
    body: h("div.stack", general, fields.path.el, fields.name.el, fields.dtype.el),
    onSubmit: async () => {
      Object.values(fields).forEach((f) => f.setError(""));
      general.hidden = true;
      try {
        const result = await post("/models/import-gguf", { path: path.value, name: name.value || undefined, dtype: dtype.value || undefined });
        toast(`Imported ${result.name}`, "ok");
      } catch (error) {
        if (fields[error.param]) fields[error.param].setError(error.message);
        else {
          general.hidden = false;
          general.textContent = error.message;
        }
        throw error;
      }
      refresh();
      return true;
    },
  });
}

async function act(button, work, done) {
  button.disabled = true;
  try {
    await work();
    done?.();
  } catch (error) {
    if (!(error instanceof ApiError && error.code === "admin_login_required")) toast(error.message, "err");
  } finally {
    button.disabled = false;
  }
}

function row(model, refresh, navigate) {
  const path = `/models/${encodeName(model.name)}`;
  const loaded = model.state === "loaded" || model.state === "pinned";
  const loadBtn = h("button.btn.small", { dataset: { action: loaded ? "unload" : "load" } }, loaded ? "Unload" : "Load");
  loadBtn.onclick = () => act(loadBtn, () => post(`${path}/${loaded ? "unload" : "load"}`), refresh);
  if (model.state === "loading") loadBtn.disabled = true;
  const pin = h("input", { type: "checkbox", checked: model.pinned, title: "Pinned: never evicted", dataset: { action: "pin" } });
  pin.onchange = () => act(pin, () => put(`${path}/settings`, { pinned: pin.checked }), refresh);
  const settings = h("button.btn.small", { dataset: { action: "settings" } }, "Settings");
  settings.onclick = () => settingsDialog(model, refresh).catch((e) => toast(e.message, "err"));
  // Embedding and rerank models serve /v1/embeddings and /v1/rerank, not chat.
  const chats = model.kind === "llm" || model.kind === "vlm";
  const chat = chats ? h("button.btn.small.ghost", { onclick: () => navigate("chat", { model: model.id }) }, "Chat") : null;
  return h(
    "tr",
    { dataset: { model: model.name, state: model.state } },
    h("td", h("div", h("strong", model.id), model.is_default ? h("span.badge.accent", { style: "margin-left:8px" }, "default") : null), h("div.muted.small", model.alias ? `folder ${model.name}` : model.model_type)),
    h("td", { dataset: { col: "kind" } }, h("span.badge", model.kind), (model.capabilities ?? []).includes("vision") ? h("span.badge.accent", { style: "margin-left:4px", title: "Takes images in chat" }, "vision") : null),
    h("td", stateBadge(model.state, model.error)),
    h("td.nowrap", formatBytes(model.size_bytes)),
    h("td.nowrap", loaded ? formatBytes(model.memory_bytes) : "–"),
    h("td", loaded ? String(model.requests_in_flight) : "–"),
    h("td.nowrap", { dataset: { col: "ttl" } }, model.ttl_s ? formatDuration(model.ttl_s) : "global"),
    h("td", h("label.row", { style: "gap:6px" }, pin, h("span.small.muted", "pin"))),
    h("td", h("div.actions", loadBtn, settings, chat)),
  );
}

export async function render(view, { navigate, params }) {
  const body = h("div.table-wrap");
  const installBtn = h("button.btn", "Install built-in model");
  const installEmbeddingBtn = h("button.btn", { dataset: { action: "install-embedding" } }, "Install embedding model");
  const refresh = async () => {
    const { models } = await get("/models");
    if (!models.length) {
      return clear(body, h("div.empty", "No models found in the model folders. Install the built-in model or import a GGUF."));
    }
    clear(
      body,
      h(
        "table.table",
        h("thead", h("tr", ["Model", "Kind", "State", "Size", "Memory", "In flight", "TTL", "Pinned", ""].map((t) => h("th", t)))),
        h("tbody", models.map((m) => row(m, refresh, navigate))),
      ),
    );
    // ?select=NAME (e.g. from a finished quantization) highlights that model.
    const selected = params.get("select");
    for (const tr of body.querySelectorAll("tr[data-model]")) tr.classList.toggle("selected", tr.dataset.model === selected);
  };
  installBtn.onclick = () =>
    act(installBtn, async () => {
      installBtn.textContent = "Installing…";
      const result = await post("/models/install-default");
      toast(result.already_installed ? `${result.name} is already installed` : `Installed ${result.name}`, "ok");
    }, refresh).finally(() => (installBtn.textContent = "Install built-in model"));
  installEmbeddingBtn.onclick = () =>
    act(installEmbeddingBtn, async () => {
      installEmbeddingBtn.textContent = "Installing…";
      const result = await post("/models/install-default", { kind: "embedding" });
      toast(result.already_installed ? `${result.name} is already installed` : `Installed ${result.name}`, "ok");
    }, refresh).finally(() => (installEmbeddingBtn.textContent = "Install embedding model"));
  view.append(
    h(
      "div.card",
      h(
        "div.card-head",
        h("h2", "Models"),
        h("div.row", h("button.btn", { onclick: () => importDialog(refresh) }, "Import GGUF…"), installBtn, installEmbeddingBtn, h("button.btn.ghost", { onclick: refresh }, "Refresh")),
      ),
      body,
    ),
  );
  await refresh();
  body.querySelector("tr.selected")?.scrollIntoView({ block: "center" });
  const timer = setInterval(() => {
    if (!document.querySelector("dialog[open]")) refresh().catch(() => {});
  }, POLL_MS);
  return () => clearInterval(timer);
}
