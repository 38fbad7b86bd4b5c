// Dashboard: status, loaded models, live charts, cache counters, the memory guard.
// Reads /admin/api/stats when the server has it; otherwise status + cache/stats.

import { ApiError, get } from "../api.js";
import { LiveChart } from "../charts.js";
import { clear, formatBytes, formatDuration, formatNumber, formatPercent, h, stateBadge } from "../ui.js";

const POLL_MS = 1500;

async function fetchStats(state) {
  if (!state.hasStats) return null;
  try {
    return await get("/stats");
  } catch (error) {
    if (error instanceof ApiError && error.status === 404) {
      state.hasStats = false; // an older server: fall back for this visit
      return null;
    }
    throw error;
  }
}

function cacheFallback(cache) {
  if (!cache?.enabled || !cache.hot) return null;
  const models = Object.values(cache.models ?? {});
  const lookups = models.reduce((n, m) => n + (m.lookups ?? 0), 0);
  const hits = models.reduce((n, m) => n + (m.hits ?? 0), 0);
  return {
    hit_rate: lookups ? hits / lookups : null,
    tokens_saved: models.reduce((n, m) => n + (m.tokens_saved ?? 0), 0),
    hot_bytes: cache.hot.hot_bytes,
    ssd_bytes: models.reduce((n, m) => n + (m.ssd?.total_bytes ?? 0), 0),
  };
}

/** One normalized sample from whatever the server offers. */
function snapshot(status, stats, cache) {
  const mem = status.memory;
  const inFlight = status.models.reduce((n, m) => n + (m.requests_in_flight ?? 0), 0);
  return {
    version: status.version,
    authEnabled: status.auth_enabled,
    models: status.models,
    guard: mem,
    loads: status.num_loads,
    evictions: status.num_evictions,
    uptime: stats?.uptime_s ?? null,
    memory: {
      used: stats?.memory?.used_bytes ?? mem.current_bytes,
      soft: stats?.memory?.soft_limit_bytes ?? mem.soft_limit_bytes,
      hard: stats?.memory?.hard_limit_bytes ?? mem.limit_bytes,
    },
    requests: stats?.requests ?? { in_flight: inFlight, queued: null, total: null, errors: null },
    throughput: stats?.throughput ?? null,
    tokens: stats?.tokens ?? null,
    cache: stats?.cache ?? cacheFallback(cache),
    cacheEnabled: cache ? cache.enabled : true,
    hotMax: cache?.hot?.max_bytes ?? null,
  };
}

function statCard(label, id) {
  return h("div.card.stat", h("div.label", label), h("div.value", { id: `${id}-value` }, "–"), h("div.sub", { id: `${id}-sub` }, " "));
}

function chartCard(title, hint, id) {
  return h("div.card", h("div.card-head", h("h2", title), h("span.hint", { id: `${id}-hint` }, hint)), h("div.chart", { id }));
}

function layout(view) {
  view.append(
    h(
      "div.stack",
      h(
        "div.grid.cols-4",
        statCard("Memory used", "stat-memory"),
        statCard("Requests in flight", "stat-requests"),
        statCard("Decode", "stat-decode"),
        statCard("Cache hit rate", "stat-cache"),
      ),
      h(
        "div.grid.cols-3",
        chartCard("Memory", "used vs soft / hard limit", "chart-memory"),
        chartCard("Throughput", "tokens per second", "chart-throughput"),
        chartCard("Requests", "in flight and queued", "chart-requests"),
      ),
      h(
        "div.grid.cols-2",
        h("div.card", h("div.card-head", h("h2", "Loaded models"), h("a.small", { href: "#/models" }, "All models →")), h("div#loaded-models.table-wrap")),
        h("div.card", h("div.card-head", h("h2", "Server")), h("dl.kv#server-info")),
      ),
      h(
        "div.grid.cols-2",
        h("div.card", h("div.card-head", h("h2", "Prefix cache")), h("dl.kv#cache-info")),
        h("div.card", h("div.card-head", h("h2", "Memory guard")), h("div#guard-info")),
      ),
    ),
  );
}

function setStat(id, value, sub) {
  document.getElementById(`${id}-value`).textContent = value;
  document.getElementById(`${id}-sub`).textContent = sub ?? " ";
}

function kv(target, pairs) {
  clear(target, pairs.flatMap(([k, v]) => [h("dt", k), h("dd", v)]));
}

function paintModels(models) {
  const loaded = models.filter((m) => !["unloaded", "failed"].includes(m.state));
  const target = document.getElementById("loaded-models");
  if (!loaded.length) return clear(target, h("div.empty", "No model is loaded. A request (or Load on the Models page) loads one."));
  clear(
    target,
    h(
      "table.table",
      h("thead", h("tr", h("th", "Model"), h("th", "State"), h("th", "Memory"), h("th", "In flight"), h("th", "Idle"))),
      h(
        "tbody",
        loaded.map((m) =>
          h("tr", { dataset: { model: m.name } }, h("td", m.id), h("td", stateBadge(m.state)), h("td", formatBytes(m.memory_bytes)), h("td", String(m.requests_in_flight)), h("td", formatDuration(m.idle_s))),
        ),
      ),
    ),
  );
}

function paint(s) {
  const { memory, requests, throughput, cache } = s;
  setStat("stat-memory", formatBytes(memory.used), `of ${formatBytes(memory.hard)} hard limit · soft ${formatBytes(memory.soft)}`);
  setStat("stat-requests", formatNumber(requests.in_flight), requests.queued === null ? "queue: needs /admin/api/stats" : `${formatNumber(requests.queued)} queued · ${formatNumber(requests.total)} total · ${formatNumber(requests.errors)} errors`);
  setStat("stat-decode", throughput ? `${formatNumber(throughput.decode_tokens_per_s, 1)} tok/s` : "–", throughput ? `prefill ${formatNumber(throughput.prefill_tokens_per_s, 1)} tok/s` : "needs /admin/api/stats");
  setStat("stat-cache", s.cacheEnabled ? formatPercent(cache?.hit_rate) : "off", s.cacheEnabled ? `${formatNumber(cache?.tokens_saved)} tokens saved` : "cache.enabled is false");
  paintModels(s.models);
  kv(document.getElementById("server-info"), [
    ["Version", s.version],
    ["Uptime", s.uptime === null ? "–" : formatDuration(s.uptime)],
    ["API key", s.authEnabled ? "required" : "off (loopback only)"],
    ["Models", `${s.models.length} found, ${s.models.filter((m) => !["unloaded", "failed"].includes(m.state)).length} loaded`],
    ["Loads / evictions", `${s.loads} / ${s.evictions}`],
    ["Tokens", s.tokens ? `${formatNumber(s.tokens.prompt_total)} prompt · ${formatNumber(s.tokens.completion_total)} completion · ${formatNumber(s.tokens.cached_total)} cached` : "–"],
  ]);
  kv(document.getElementById("cache-info"), s.cacheEnabled ? [
    ["Hit rate", formatPercent(cache?.hit_rate)],
    ["Tokens saved", formatNumber(cache?.tokens_saved)],
    ["RAM tier", `${formatBytes(cache?.hot_bytes)}${s.hotMax ? ` of ${formatBytes(s.hotMax)}` : ""}`],
    ["SSD tier", formatBytes(cache?.ssd_bytes)],
  ] : [["State", "disabled (cache.enabled = false)"]]);
  paintGuard(s.guard);
}

function paintGuard(g) {
  const target = document.getElementById("guard-info");
  const dl = h("dl.kv");
  kv(dl, [
    ["Hard limit", formatBytes(g.limit_bytes)],
    ["Soft limit", formatBytes(g.soft_limit_bytes)],
    ["Transient margin", formatBytes(g.transient_margin_bytes)],
    ["Weights budget", formatBytes(g.model_budget_bytes)],
    ["Current", `${formatBytes(g.current_bytes)} (MLX ${formatBytes(g.reading.mlx_active_bytes)}, process ${formatBytes(g.reading.process_footprint_bytes)}, peak ${formatBytes(g.reading.recent_peak_bytes)})`],
  ]);
  const guards = Object.entries(g.guards ?? {});
  clear(target, dl, guards.length ? h("div.stack", { style: "margin-top:12px;gap:6px" }, guards.map(([, text]) => h("code.small", text))) : h("p.muted.small", "Per-model guards appear when a model is loaded."));
}

export async function render(view) {
  layout(view);
  const state = { hasStats: true, stopped: false, timer: null };
  const bytes = (v) => formatBytes(v);
  const rate = (v) => formatNumber(v, v < 10 ? 1 : 0);
  const charts = {
    memory: new LiveChart(document.getElementById("chart-memory"), {
      format: bytes,
      series: [
        { label: "used", color: "--chart-1", fill: true },
        { label: "soft", color: "--chart-3", dash: [6, 4] },
        { label: "hard", color: "--chart-4", dash: [6, 4] },
      ],
    }),
    throughput: new LiveChart(document.getElementById("chart-throughput"), {
      format: rate,
      series: [
        { label: "decode", color: "--chart-1", fill: true },
        { label: "prefill", color: "--chart-2" },
      ],
    }),
    requests: new LiveChart(document.getElementById("chart-requests"), {
      format: (v) => formatNumber(v),
      integer: true,
      series: [
        { label: "in flight", color: "--chart-1", fill: true },
        { label: "queued", color: "--chart-3" },
      ],
    }),
  };

  async function tick() {
    try {
      const [status, stats] = await Promise.all([get("/status"), fetchStats(state)]);
      const cache = stats ? null : await get("/cache/stats");
      if (state.stopped) return;
      const s = snapshot(status, stats, cache);
      const now = Date.now() / 1000;
      charts.memory.push(now, [s.memory.used, s.memory.soft, s.memory.hard]);
      charts.throughput.push(now, s.throughput ? [s.throughput.decode_tokens_per_s, s.throughput.prefill_tokens_per_s] : [null, null]);
      charts.requests.push(now, [s.requests.in_flight, s.requests.queued]);
      if (!s.throughput) document.getElementById("chart-throughput-hint").textContent = "needs /admin/api/stats";
      paint(s);
    } catch (error) {
      if (!(error instanceof ApiError && error.code === "admin_login_required")) console.warn("dashboard poll failed:", error.message);
    }
    if (!state.stopped) state.timer = setTimeout(tick, POLL_MS);
  }
  await tick();
  return () => {
    state.stopped = true;
    clearTimeout(state.timer);
    Object.values(charts).forEach((c) => c.destroy());
  };
}
