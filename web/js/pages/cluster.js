// Cluster: the ranks of a model split across machines (omlx serve --distributed), each
// with its state and memory, from /admin/api/cluster; on `omlx router`, its backends
// from the router's /health.

import { CLIENT_HEADERS, get } from "../api.js";
import { clear, formatBytes, formatNumber, h } from "../ui.js";

const POLL_MS = 2000;

function badge(state) {
  const kind = { serving: "ok", following: "ok", healthy: "ok", lost: "err", down: "err" }[state] ?? "";
  return h(`span.badge${kind ? "." + kind : ""}`, { dataset: { state } }, state);
}

function memoryCell(memory) {
  if (!memory) return h("span.muted", "not reported yet");
  const used = memory.resident_bytes;
  const share = memory.limit_bytes ? ` (${Math.round((100 * used) / memory.limit_bytes)}%)` : "";
  return `${formatBytes(used)} of ${formatBytes(memory.limit_bytes)}${share}`;
}

function rankRow(rank) {
  return h(
    "tr",
    { dataset: { rank: String(rank.rank) } },
    h("td", `rank ${rank.rank}`),
    h("td", badge(rank.state)),
    h("td.memory", memoryCell(rank.memory)),
    h("td.muted", rank.error ?? (rank.rank === 0 ? "serves HTTP, runs the scheduler" : "follows rank 0")),
  );
}

function ranksCard(report) {
  const summary = report.healthy
    ? h("span.badge.ok", "healthy")
    : h("span.badge.err", "a rank is lost: requests get 503 until the cluster restarts");
  return h(
    "div.card",
    { id: "cluster-ranks" },
    h("div.card-head", h("h2", `${report.model} · ${report.parallel} parallel over ${report.world_size} ranks`), summary),
    h("p.muted.small", `MLX backend: ${report.backend}. Each rank checks its own memory ceiling; a step any rank cannot afford is not run.`),
    h(
      "div.table-wrap",
      h("table.table", h("thead", h("tr", h("th", "Rank"), h("th", "State"), h("th", "Memory"), h("th", "Role"))), h("tbody", report.ranks.map(rankRow))),
    ),
  );
}

function backendRow(b) {
  return h(
    "tr",
    { dataset: { backend: b.url } },
    h("td", b.url),
    h("td", badge(b.healthy ? "healthy" : "down")),
    h("td", b.models.join(", ") || h("span.muted", "none")),
    h("td", formatNumber(b.requests_in_flight ?? b.in_flight ?? 0)),
    h("td", !b.healthy || b.memory_headroom_bytes == null ? "–" : formatBytes(b.memory_headroom_bytes)),
    h("td", formatNumber(b.requests_routed ?? 0)),
    h("td.muted", b.error ?? ""),
  );
}

function backendsCard(health) {
  return h(
    "div.card",
    { id: "router-backends" },
    h("div.card-head", h("h2", `Backends · ${health.healthy} of ${health.total} healthy`)),
    h(
      "div.table-wrap",
      h(
        "table.table",
        h("thead", h("tr", ...["Backend", "State", "Models", "In flight", "Memory headroom", "Routed", "Error"].map((t) => h("th", t)))),
        h("tbody", health.backends.map(backendRow)),
      ),
    ),
  );
}

async function routerHealth() {
  // The router's /health answers 503 when no backend is healthy: still a report.
  const response = await fetch("/health", { headers: CLIENT_HEADERS });
  return response.json();
}

export async function render(view, { router = false } = {}) {
  const box = h("div.stack");
  view.append(box);
  async function refresh() {
    if (router) {
      clear(box, backendsCard(await routerHealth()));
      return;
    }
    const { distributed } = await get("/cluster");
    if (!distributed) {
      clear(box, h("div.notice", { id: "cluster-single" }, "This server runs its models in one process. Start it with `omlx serve --distributed MODEL` under mlx.launch to split one model across machines (`omlx cluster` writes the hostfile and prints the command)."));
      return;
    }
    clear(box, ranksCard(distributed));
  }
  await refresh();
  const timer = setInterval(() => refresh().catch(() => {}), POLL_MS);
  return () => clearInterval(timer);
}
