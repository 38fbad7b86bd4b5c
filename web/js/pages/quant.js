// Quantization: start an oQ task, watch its progress, cancel it, see its results,
// open the new model.

import { ApiError, del, get, post } from "../api.js";
import { clear, field, formatBytes, formatDuration, formatNumber, h, toast, uid } from "../ui.js";

const POLL_MS = 1000;
const ACTIVE = new Set(["queued", "loading", "measuring", "quantizing", "evaluating", "saving"]);
const PHASE_KIND = { done: "ok", failed: "err", cancelled: "", queued: "" };

function histogram(bits) {
  if (!bits) return null;
  return Object.entries(bits)
    .sort(([a], [b]) => Number(a) - Number(b))
    .map(([b, n]) => `${b}-bit × ${n}`)
    .join(", ");
}

function resultView(task, navigate) {
  const r = task.result;
  if (!r) return null;
  const ppl = (v) => (v === null || v === undefined ? "–" : formatNumber(v, 2));
  return h(
    "div.stack",
    { style: "gap:10px;margin-top:12px" },
    h(
      "dl.kv.quant-result",
      h("dt", "Size"), h("dd", formatBytes(r.size_bytes)),
      h("dt", "Bits per weight"), h("dd", formatNumber(r.bits_per_weight, 2)),
      h("dt", "Perplexity"), h("dd", `${ppl(r.perplexity_before)} → ${ppl(r.perplexity_after)}`),
      h("dt", "Layers"), h("dd", `${r.num_layers ?? "–"}${r.bits_histogram ? ` (${histogram(r.bits_histogram)})` : ""}`),
    ),
    h(
      "div.row",
      h("button.btn.small", { dataset: { action: "open-model" }, onclick: () => navigate("models", { select: task.output_name }) }, "Open in Models"),
      h("button.btn.small.primary", { dataset: { action: "chat-model" }, onclick: () => navigate("chat", { model: task.output_name }) }, "Chat with it"),
    ),
  );
}

function taskCard(task, refresh, navigate) {
  const active = ACTIVE.has(task.phase);
  const kind = PHASE_KIND[task.phase] ?? "warn";
  const percent = Math.max(0, Math.min(100, task.percent ?? 0));
  const actions = h("div.row");
  if (active) {
    actions.append(h("button.btn.small.danger", { dataset: { action: "cancel" }, onclick: () => post(`/quant/tasks/${task.id}/cancel`).then(refresh, (e) => toast(e.message, "err")) }, "Cancel"));
  } else {
    actions.append(h("button.btn.small.ghost", { dataset: { action: "delete" }, onclick: () => del(`/quant/tasks/${task.id}`).then(refresh, (e) => toast(e.message, "err")) }, "Remove"));
  }
  return h(
    "div.card",
    { dataset: { task: task.id, phase: task.phase } },
    h(
      "div.card-head",
      h("div", h("h2", task.output_name ?? `${task.model} ${task.level}`), h("div.muted.small", `${task.model} · ${task.level} · group ${task.group_size}`)),
      h("div.row", h(`span.badge${kind ? "." + kind : ""}.phase`, task.phase), actions),
    ),
    h("div.progress", { role: "progressbar", "aria-valuenow": String(percent), "aria-valuemin": "0", "aria-valuemax": "100" }, h("div", { style: `width:${percent}%` })),
    h(
      "div.row.small.muted",
      { style: "margin-top:8px;gap:18px" },
      h("span", `${formatNumber(percent, 0)}%`),
      h("span", `elapsed ${formatDuration(task.elapsed_s)}`),
      active ? h("span", `ETA ${formatDuration(task.eta_s)}`) : null,
      task.output_path ? h("code", task.output_path) : null,
    ),
    task.error ? h("div.notice.err", { style: "margin-top:10px" }, task.error) : null,
    resultView(task, navigate),
  );
}

function startForm(models, levels, refresh) {
  const model = h("select", { id: uid(), name: "model" }, models.map((m) => h("option", { value: m.name }, m.id)));
  const level = h("select", { id: uid(), name: "level" }, levels.map((l) => h("option", { value: l.name }, `${l.name} (${formatNumber(l.target_bits_per_weight, 1)} bpw)`)));
  const defaultLevel = levels.find((l) => l.name === "oQ4");
  if (defaultLevel) level.value = defaultLevel.name;
  const group = h("select", { id: uid(), name: "group_size" }, [32, 64, 128].map((g) => h("option", { value: String(g), selected: g === 64 }, String(g))));
  const output = h("input", { id: uid(), name: "output_name", placeholder: "(automatic)" });
  const fields = {
    model: field({ label: "Model", input: model, name: "model" }),
    level: field({ label: "Level", input: level, name: "level" }),
    group_size: field({ label: "Group size", input: group, name: "group_size" }),
    output_name: field({ label: "Output name", input: output, name: "output_name" }),
  };
  const estimate = h("div.notice", { id: "quant-estimate" }, "…");
  const start = h("button.btn.primary", { type: "submit", id: "quant-start" }, "Start quantization");
  const body = () => ({ model: model.value, level: level.value, group_size: Number(group.value), output_name: output.value.trim() || undefined });
  const showError = (error) => {
    if (fields[error.param]) fields[error.param].setError(error.message);
    else toast(error.message, "err");
  };
  const updateEstimate = async () => {
    Object.values(fields).forEach((f) => f.setError(""));
    if (!model.value) return;
    try {
      const e = await post("/quant/estimate", body());
      estimate.className = "notice";
      estimate.textContent = `${formatBytes(e.source_bytes)} → about ${formatBytes(e.estimated_bytes)} at ${formatNumber(e.target_bits_per_weight, 2)} bits per weight; needs about ${formatBytes(e.estimated_memory_bytes)} of memory while it runs.`;
    } catch (error) {
      estimate.className = "notice err";
      estimate.textContent = error.message;
    }
  };
  [model, level, group].forEach((el) => el.addEventListener("change", updateEstimate));
  const form = h(
    "form.card",
    { novalidate: true, id: "quant-form" },
    h("div.card-head", h("h2", "New oQ task"), h("span.hint", "Mixed precision from measured layer sensitivity; output is a normal mlx-lm folder.")),
    h("div.fields", Object.values(fields).map((f) => f.el)),
    h("div.stack", { style: "margin-top:16px;gap:12px" }, estimate, h("div.row", start)),
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    Object.values(fields).forEach((f) => f.setError(""));
    start.disabled = true;
    try {
      const task = await post("/quant/tasks", body());
      toast(`Started ${task.output_name ?? task.id}`, "ok");
      output.value = "";
      refresh();
    } catch (error) {
      showError(error);
    } finally {
      start.disabled = false;
    }
  });
  updateEstimate();
  return form;
}

export async function render(view, { navigate }) {
  let levels;
  try {
    ({ levels } = await get("/quant/levels"));
  } catch (error) {
    if (error instanceof ApiError && error.status === 404) {
      view.append(h("div.notice.warn", "This server has no quantization API (/admin/api/quant)."));
      return undefined;
    }
    throw error;
  }
  const { models: all } = await get("/models");
  // oQ quantizes text LLMs (through mlx-lm).
  const models = all.filter((m) => m.kind === "llm");
  const list = h("div.stack", { id: "quant-tasks" });
  const state = { timer: null, stopped: false };
  const refresh = async () => {
    const { tasks } = await get("/quant/tasks");
    if (!tasks.length) return clear(list, h("div.card.empty", "No quantization tasks yet."));
    const created = (t) => (typeof t.created_at === "number" ? t.created_at : Date.parse(t.created_at) || 0);
    const sorted = [...tasks].sort((a, b) => created(b) - created(a));
    clear(list, sorted.map((t) => taskCard(t, refresh, navigate)));
  };
  const poll = async () => {
    try {
      await refresh();
    } catch (error) {
      console.warn("quant poll failed:", error.message);
    }
    if (!state.stopped) state.timer = setTimeout(poll, POLL_MS);
  };
  view.append(h("div.stack", startForm(models, levels, refresh), h("h3", "Tasks"), list));
  await poll();
  return () => {
    state.stopped = true;
    clearTimeout(state.timer);
  };
}
