// Download: find an MLX model on the Hugging Face Hub (search or a pasted repo id),
// see whether it fits before a byte is fetched, download it, watch and cancel.
// A GGUF-only repo lists its files: one click downloads a file and imports it.

import { ApiError, del, get, post } from "../api.js";
import { clear, field, formatBytes, formatDuration, formatNumber, h, toast, uid } from "../ui.js";

const POLL_MS = 1000;
const ACTIVE = new Set(["queued", "downloading", "finishing", "importing"]);
const PHASE_LABEL = { importing: "importing…" };
const DTYPES = [
  ["", "automatic (quantized on a Mac's GPU, float32 on CPU)"],
  ["keep", "keep quantized"],
  ["float16", "float16"],
  ["float32", "float32"],
];
const PHASE_KIND = { done: "ok", failed: "err", cancelled: "", queued: "" };
const VERDICT_KIND = { fits: "ok", fits_shorter_context: "warn", does_not_fit: "err" };
const REPO_ID = /^[A-Za-z0-9][\w.-]*\/[\w.-]+$/;

// -- errors in words ------------------------------------------------------------

/** What to do about an error, beyond the server's own message (which names the cause). */
function errorHint(error) {
  const code = error.code ?? "";
  if (code === "hub_token_required" || error.status === 401 || error.status === 403) {
    return ["This repo needs a Hugging Face token: set ", settingsLink("models.hf_token"), " (or HF_TOKEN) to a read token whose account accepted the repo's terms."];
  }
  if (code === "hub_unreachable" || error.status === 502) {
    return ["The Hub could not be reached. Offline? Set a mirror in ", settingsLink("models.hf_endpoint"), " (or HF_ENDPOINT)."];
  }
  if (code === "not_a_model") return ["Not an MLX model omlx can load: look for an mlx-community conversion of it."];
  if (error.status === 507) return ["Not enough disk space: free some, or add a model dir on a larger disk in Settings."];
  if (error.status === 409) return ["A model with that name exists: Inspect the repo and give the download another name."];
  return [];
}

function settingsLink(name) {
  return h("a", { href: "#/settings", dataset: { setting: name } }, h("code", name));
}

function errorNotice(error, prefix = "") {
  const hint = errorHint(error);
  return h(
    "div.notice.err",
    { dataset: { errorCode: error.code ?? String(error.status ?? "") } },
    h("div", prefix, error.message),
    hint.length ? h("div.small", { style: "margin-top:4px" }, hint) : null,
  );
}

// -- the fit verdict ----------------------------------------------------------------

export function fitBadge(fit) {
  if (!fit) return h("span.badge.fit", { dataset: { verdict: "unknown" }, title: "No config.json to estimate from" }, "unknown");
  const kind = VERDICT_KIND[fit.verdict] ?? "";
  const title = `needs ${formatBytes(fit.total_bytes)} of ${formatBytes(fit.limit_bytes)}: weights ${formatBytes(fit.weights_bytes)}, KV ${formatBytes(fit.kv_bytes)}, transient ${formatBytes(fit.transient_bytes)}`;
  return h(`span.badge.fit${kind ? "." + kind : ""}`, { dataset: { verdict: fit.verdict }, title }, fit.message);
}

function fitDetails(fit) {
  if (!fit) return h("div.muted.small", "No fit estimate: the repo has no config.json to read.");
  const context = `${formatNumber(fit.context_tokens)} tokens × ${fit.concurrency} concurrent requests`;
  return h(
    "div.stack.fit-details",
    { style: "gap:8px" },
    h("div", fitBadge(fit)),
    h(
      "dl.kv",
      h("dt", "Weights"), h("dd", formatBytes(fit.weights_bytes)),
      h("dt", "KV cache"), h("dd", `${formatBytes(fit.kv_bytes)} (${context})`),
      h("dt", "Prefill transient"), h("dd", formatBytes(fit.transient_bytes)),
      fit.baseline_bytes ? [h("dt", "Already in use"), h("dd", formatBytes(fit.baseline_bytes))] : null,
      h("dt", "Total"), h("dd", `${formatBytes(fit.total_bytes)} of ${formatBytes(fit.limit_bytes)} (memory.max_process_memory)`),
    ),
    (fit.notes ?? []).map((note) => h("div.muted.small", `Assumed: ${note}`)),
    fit.verdict === "does_not_fit" ? h("div.small.muted", "You can still download it: a higher memory.max_process_memory, or fewer concurrent requests, may let it run.") : null,
  );
}

// -- search -------------------------------------------------------------------------

function resultsTable(results, actions) {
  if (!results.length) return h("div.card.empty", "No MLX models match.");
  const rows = results.map((r) =>
    h(
      "tr",
      { dataset: { repo: r.repo_id } },
      h("td", h("strong", r.repo_id)),
      h("td.nowrap", formatNumber(r.downloads)),
      h("td.nowrap", formatBytes(r.size_bytes)),
      h("td.nowrap", r.quantization ?? "–"),
      h("td", fitBadge(r.fit)),
      h(
        "td",
        h(
          "div.actions",
          h("button.btn.small", { dataset: { action: "inspect" }, onclick: () => actions.inspect(r.repo_id) }, "Inspect"),
          h("button.btn.small.primary", { dataset: { action: "download" }, onclick: (e) => actions.start(e.currentTarget, { repo_id: r.repo_id }) }, "Download"),
        ),
      ),
    ),
  );
  const head = h("tr", ["Repo", "Downloads", "Size", "Quantization", "Fit", ""].map((t) => h("th", t)));
  return h("div.card", h("div.table-wrap", h("table.table", h("thead", head), h("tbody", rows))));
}

// -- inspection ----------------------------------------------------------------------

function fileList(files) {
  return h(
    "details.files",
    h("summary", `${files.length} file${files.length === 1 ? "" : "s"}`),
    h("ul.file-list", files.map((f) => h("li", h("code", f.name), h("span.muted", formatBytes(f.size))))),
  );
}

function mlxInspection(info, actions) {
  const name = h("input", { id: uid(), name: "name", placeholder: info.repo_id.split("/").pop() });
  const nameField = field({ label: "Model name", input: name, name: "name", help: "The folder in the first model dir; empty: the repo's name." });
  const short = info.disk_free_bytes !== null && info.disk_free_bytes !== undefined && info.total_bytes > info.disk_free_bytes;
  const start = h("button.btn.primary", { id: "download-start", dataset: { action: "start" } }, "Download");
  start.onclick = () => actions.start(start, { repo_id: info.repo_id, revision: info.revision, name: name.value.trim() || undefined }, nameField);
  return [
    h(
      "dl.kv",
      h("dt", "Revision"), h("dd", h("code", info.revision)),
      h("dt", "Files"), h("dd", fileList(info.files)),
      h("dt", "Download size"), h("dd", { dataset: { field: "total" } }, formatBytes(info.total_bytes)),
      h("dt", "Disk free"), h("dd", formatBytes(info.disk_free_bytes)),
      h("dt", "Fit"), h("dd", fitDetails(info.fit)),
    ),
    short ? h("div.notice.err", `Not enough disk space: needs ${formatBytes(info.total_bytes)}, ${formatBytes(info.disk_free_bytes)} free.`) : null,
    h("div.row.download-start", nameField.el, start),
  ];
}

function localImportForm(refreshModels) {
  const path = h("input", { id: uid(), name: "path", placeholder: "/path/to/model.gguf" });
  const pathField = field({ label: "Or import a GGUF file already on this machine", input: path, name: "path" });
  const button = h("button.btn", { dataset: { action: "import-gguf" } }, "Import");
  button.onclick = async () => {
    pathField.setError("");
    button.disabled = true;
    try {
      const result = await post("/models/import-gguf", { path: path.value.trim() });
      toast(`Imported ${result.name}`, "ok");
      refreshModels();
    } catch (error) {
      pathField.setError(error.message);
    } finally {
      button.disabled = false;
    }
  };
  return h("div.row.download-start", pathField.el, button);
}

function ggufInspection(info, actions) {
  const dtype = h("select", { id: uid(), name: "dtype" }, DTYPES.map(([value, label]) => h("option", { value }, label)));
  const dtypeField = field({ label: "Weights after the import", input: dtype, name: "dtype" });
  const files = info.gguf_files.map((f) => {
    const start = h("button.btn.small.primary", { dataset: { action: "download-gguf" } }, "Download and import");
    start.onclick = () => actions.start(start, { repo_id: info.repo_id, revision: info.revision, gguf_file: f.name, dtype: dtype.value || undefined });
    return h("li", { dataset: { gguf: f.name } }, h("code", f.name), h("span.muted", formatBytes(f.size)), start);
  });
  return [
    h("div.notice.warn", "This repo holds GGUF files, not an MLX model: pick one to download; omlx then converts it into an MLX model folder and removes the GGUF. Whether it fits your memory is shown once it is imported."),
    dtypeField.el,
    h("ul.file-list.gguf-files", files),
    h("div.small.muted", `Disk free: ${formatBytes(info.disk_free_bytes)}`),
    localImportForm(actions.refresh),
  ];
}

function inspectionCard(info, actions) {
  const body = info.kind === "gguf" ? ggufInspection(info, actions) : mlxInspection(info, actions);
  return h(
    "div.card",
    { dataset: { repo: info.repo_id, kind: info.kind } },
    h("div.card-head", h("h2", info.repo_id), h(`span.badge${info.kind === "mlx" ? ".accent" : ".warn"}`, info.kind === "mlx" ? "MLX model" : "GGUF only")),
    h("div.stack", { style: "gap:12px" }, body),
  );
}

// -- downloads --------------------------------------------------------------------------

function progressText(task) {
  if (task.phase === "importing") return `converting ${task.gguf_file} into an MLX folder…`;
  const total = task.bytes_total ? ` of ${formatBytes(task.bytes_total)}` : "";
  const parts = [`${formatBytes(task.bytes_done)}${total}`];
  if (ACTIVE.has(task.phase) && task.speed_bps) parts.push(`${formatBytes(task.speed_bps)}/s`);
  if (ACTIVE.has(task.phase) && task.eta_s !== null && task.eta_s !== undefined) parts.push(`ETA ${formatDuration(task.eta_s)}`);
  return parts.join(" · ");
}

function downloadCard(task, refresh, navigate) {
  const active = ACTIVE.has(task.phase);
  const kind = PHASE_KIND[task.phase] ?? "warn";
  const percent = task.phase === "done" ? 100 : task.bytes_total ? Math.min(100, (100 * task.bytes_done) / task.bytes_total) : 0;
  const actions = h("div.row");
  const fail = (e) => toast(e.message, "err");
  if (active) {
    actions.append(h("button.btn.small.danger", { dataset: { action: "cancel" }, onclick: () => post(`/models/downloads/${task.id}/cancel`).then(refresh, fail) }, "Cancel"));
  } else {
    if (task.phase === "done") {
      actions.append(h("button.btn.small", { dataset: { action: "open-model" }, onclick: () => navigate("models", { select: task.name }) }, "Open in Models"));
    }
    actions.append(h("button.btn.small.ghost", { dataset: { action: "delete" }, onclick: () => del(`/models/downloads/${task.id}`).then(refresh, fail) }, "Remove"));
  }
  return h(
    "div.card",
    { dataset: { download: task.id, phase: task.phase } },
    h(
      "div.card-head",
      h("div", h("h2", task.name ?? task.repo_id), h("div.muted.small", `${task.repo_id}${task.gguf_file ? " / " + task.gguf_file : ""}${task.revision ? " @ " + task.revision : ""}`)),
      h("div.row", task.fit ? fitBadge(task.fit) : null, h(`span.badge${kind ? "." + kind : ""}.phase`, PHASE_LABEL[task.phase] ?? task.phase), actions),
    ),
    h("div.progress", { role: "progressbar", "aria-valuenow": String(Math.round(percent)), "aria-valuemin": "0", "aria-valuemax": "100" }, h("div", { style: `width:${percent}%` })),
    h("div.row.small.muted", { style: "margin-top:8px;gap:18px" }, h("span", `${formatNumber(percent, 0)}%`), h("span.bytes", progressText(task))),
    task.error ? h("div.notice.err", { style: "margin-top:10px" }, task.error) : null,
    task.result?.conversion ? conversionSummary(task.result) : null,
  );
}

/** What a GGUF import made of each tensor type, and that the GGUF is gone. */
function conversionSummary(result) {
  const conversion = result.conversion;
  const types = Object.entries(conversion.tensor_types ?? {}).map(([kind, what]) => h("li", h("code", kind), ` ${what.tensors} tensors ${what.became}`));
  return h(
    "details.conversion",
    { style: "margin-top:8px" },
    h("summary.small", `Imported as ${conversion.model_type} (${conversion.dtype})${result.gguf_removed ? "; the GGUF was removed" : ""}`),
    h("ul.file-list", types),
  );
}

// -- the page -----------------------------------------------------------------------------

function searchForm(actions) {
  const query = h("input", { id: "hub-query", name: "q", placeholder: "Search MLX models, or paste a repo id such as mlx-community/Qwen3-0.6B-4bit", autocomplete: "off" });
  const search = h("button.btn.primary", { type: "submit", id: "hub-search" }, "Search");
  const inspect = h("button.btn", { type: "button", id: "hub-inspect" }, "Inspect repo");
  inspect.onclick = () => actions.inspect(query.value.trim());
  const form = h(
    "form.card",
    { id: "hub-form", novalidate: true },
    h("div.card-head", h("h2", "Get a model from Hugging Face"), h("span.hint", "MLX models, most downloaded first; the fit is checked against your memory limit.")),
    h("div.row.hub-search", query, search, inspect),
  );
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const text = query.value.trim();
    if (REPO_ID.test(text)) actions.inspect(text);
    else actions.search(text);
  });
  return form;
}

export async function render(view, { navigate }) {
  try {
    await get("/models/downloads");
  } catch (error) {
    if (error instanceof ApiError && error.status === 404) {
      view.append(h("div.notice.warn", "This server has no download API (/admin/api/models/downloads)."));
      return undefined;
    }
    throw error;
  }
  const status = h("div#hub-status");
  const results = h("div#hub-results");
  const inspection = h("div#hub-inspection");
  const list = h("div.stack", { id: "downloads" });
  const state = { timer: null, stopped: false };

  const refresh = async () => {
    const { downloads } = await get("/models/downloads");
    if (!downloads.length) return clear(list, h("div.card.empty", "No downloads yet."));
    const sorted = [...downloads].sort((a, b) => (b.created_at ?? 0) - (a.created_at ?? 0));
    clear(list, sorted.map((t) => downloadCard(t, refresh, navigate)));
  };
  const busy = (text) => clear(status, h("div.notice", text));
  const actions = {
    refresh,
    search: async (text) => {
      busy(text ? `Searching the Hub for “${text}”…` : "Listing the most downloaded MLX models…");
      try {
        const found = await get(`/hub/search?${new URLSearchParams({ q: text, limit: "20" })}`);
        clear(status);
        clear(results, resultsTable(found.results, actions));
      } catch (error) {
        clear(status, errorNotice(error, "Search failed: "));
      }
    },
    inspect: async (repoId) => {
      if (!repoId) return clear(status, h("div.notice.err", "Type a repo id such as mlx-community/Qwen3-0.6B-4bit."));
      busy(`Reading ${repoId} on the Hub…`);
      clear(inspection);
      try {
        const info = await post("/models/downloads/inspect", { repo_id: repoId });
        clear(status);
        clear(inspection, inspectionCard(info, actions));
        inspection.scrollIntoView({ block: "nearest" });
      } catch (error) {
        clear(status, errorNotice(error));
      }
    },
    start: async (button, body, nameField) => {
      button.disabled = true;
      nameField?.setError("");
      try {
        const { task } = await post("/models/downloads", body);
        toast(`Downloading ${task.name ?? task.repo_id}`, "ok");
        clear(status);
        await refresh();
      } catch (error) {
        if (nameField && error.param === "name") nameField.setError(error.message);
        else clear(status, errorNotice(error));
      } finally {
        button.disabled = false;
      }
    },
  };
  const poll = async () => {
    try {
      await refresh();
    } catch (error) {
      console.warn("download poll failed:", error.message);
    }
    if (!state.stopped) state.timer = setTimeout(poll, POLL_MS);
  };
  view.append(h("div.stack", searchForm(actions), status, inspection, results, h("h3", "Downloads"), list));
  await poll();
  return () => {
    state.stopped = true;
    clearTimeout(state.timer);
  };
}
