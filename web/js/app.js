// The shell: navigation, hash routing, theme, login gate and the server status pill.

import { ApiError, CLIENT_HEADERS, get, post } from "./api.js";
import { clear, h, icon, toast } from "./ui.js";

const PAGES = [
  { id: "dashboard", title: "Dashboard", icon: "dashboard", load: () => import("./pages/dashboard.js") },
  { id: "models", title: "Models", icon: "models", load: () => import("./pages/models.js") },
  { id: "download", title: "Download", icon: "download", load: () => import("./pages/download.js") },
  { id: "settings", title: "Settings", icon: "settings", load: () => import("./pages/settings.js") },
  { id: "quant", title: "Quantization", icon: "quant", load: () => import("./pages/quant.js") },
  { id: "connect", title: "Connect", icon: "connect", load: () => import("./pages/connect.js") },
  { id: "chat", title: "Chat", icon: "chat", load: () => import("./pages/chat.js") },
  { id: "logs", title: "Logs", icon: "logs", load: () => import("./pages/logs.js") },
  { id: "bench", title: "Benchmark", icon: "bench", load: () => import("./pages/bench.js") },
  { id: "cluster", title: "Cluster", icon: "cluster", load: () => import("./pages/cluster.js") },
];
// Served by `omlx router`: its one page, the backends (the rest needs an omlx server).
const ROUTER_PAGES = [
  { id: "backends", title: "Backends", icon: "cluster", load: () => import("./pages/cluster.js"), options: { router: true } },
];
let pages = PAGES;
const LOGIN = { id: "login", title: "Log in", load: () => import("./pages/login.js") };

const view = document.getElementById("view");
const title = document.getElementById("page-title");
let cleanup = null;
let renderToken = 0;
let authEnabled = false;

function parseHash() {
  const raw = location.hash.replace(/^#\/?/, "");
  const [id, query = ""] = raw.split("?");
  return { id: id || pages[0].id, params: new URLSearchParams(query) };
}

export function navigate(id, params = {}) {
  const query = new URLSearchParams(params).toString();
  location.hash = `#/${id}${query ? "?" + query : ""}`;
}

async function route() {
  const { id, params } = parseHash();
  const page = id === "login" ? LOGIN : pages.find((p) => p.id === id);
  if (!page) return navigate(pages[0].id);
  const token = ++renderToken;
  if (cleanup) cleanup();
  cleanup = null;
  for (const link of document.querySelectorAll(".nav a")) {
    link.classList.toggle("active", link.dataset.page === page.id);
  }
  title.textContent = page.title;
  document.title = `${page.title} · omlx admin`;
  clear(view);
  view.dataset.page = page.id;
  try {
    const module = await page.load();
    if (token !== renderToken) return;
    const result = await module.render(view, { params, navigate, authEnabled: () => authEnabled, ...page.options });
    if (token !== renderToken) {
      if (typeof result === "function") result();
      return;
    }
    cleanup = typeof result === "function" ? result : null;
  } catch (error) {
    if (token !== renderToken) return;
    if (error instanceof ApiError && error.code === "admin_login_required") return;
    clear(view, h("div.notice.err", `This page failed to load: ${error.message}`));
  }
}

// -- theme ---------------------------------------------------------------------

function effectiveTheme() {
  const forced = document.documentElement.dataset.theme;
  if (forced) return forced;
  return matchMedia("(prefers-color-scheme: dark)").matches ? "dark" : "light";
}

function paintThemeButton() {
  const button = document.getElementById("theme-toggle");
  clear(button, icon(effectiveTheme() === "dark" ? "sun" : "moon"));
}

function toggleTheme() {
  const next = effectiveTheme() === "dark" ? "light" : "dark";
  document.documentElement.dataset.theme = next;
  try {
    localStorage.setItem("omlx.theme", next);
  } catch (_) {
    /* not saved: fine for this visit */
  }
  paintThemeButton();
  window.dispatchEvent(new CustomEvent("omlx:theme"));
}

// -- status pill and login ---------------------------------------------------------

async function refreshPill() {
  const pill = document.getElementById("server-pill");
  try {
    const response = await fetch("/health", { headers: CLIENT_HEADERS });
    const health = await response.json();
    pill.className = "server-pill up";
    pill.textContent = health.backends ? `router · ${health.healthy}/${health.total} up` : `online · v${health.version}`;
  } catch (_) {
    pill.className = "server-pill down";
    pill.textContent = "offline";
  }
}

async function checkAuth() {
  try {
    const status = await get("/status");
    authEnabled = Boolean(status.auth_enabled);
  } catch (error) {
    if (error instanceof ApiError && error.code === "admin_login_required") authEnabled = true;
  }
  document.getElementById("logout").hidden = !authEnabled;
}

async function logout() {
  try {
    await post("/logout");
  } finally {
    navigate("login");
  }
}

/** `omlx router` answers /health with its backends: it gets the router's pages. */
async function detectRouter() {
  try {
    const health = await (await fetch("/health", { headers: CLIENT_HEADERS })).json();
    if (Array.isArray(health.backends)) pages = ROUTER_PAGES;
  } catch (_) {
    /* offline: the omlx pages, as before */
  }
}

function buildNav() {
  const nav = document.getElementById("nav");
  for (const page of pages) {
    nav.append(h("a", { href: `#/${page.id}`, dataset: { page: page.id } }, icon(page.icon), page.title));
  }
}

window.addEventListener("omlx:login-required", () => {
  authEnabled = true;
  document.getElementById("logout").hidden = false;
  const { id } = parseHash();
  if (id !== "login") navigate("login", { next: location.hash.replace(/^#\/?/, "") });
});
window.addEventListener("omlx:logged-in", () => checkAuth());
window.addEventListener("hashchange", route);
window.addEventListener("unhandledrejection", (event) => {
  if (event.reason instanceof ApiError && event.reason.code === "admin_login_required") {
    event.preventDefault();
    return;
  }
  toast(String(event.reason?.message ?? event.reason), "err");
});
matchMedia("(prefers-color-scheme: dark)").addEventListener("change", () => {
  paintThemeButton();
  window.dispatchEvent(new CustomEvent("omlx:theme"));
});

await detectRouter();
buildNav();
paintThemeButton();
document.getElementById("theme-toggle").addEventListener("click", toggleTheme);
document.getElementById("logout").addEventListener("click", logout);
refreshPill();
setInterval(refreshPill, 5000);
if (pages === ROUTER_PAGES) route();
else checkAuth().then(route);
