// Logs: the tail of <base>/logs/server.log, filtered by level, following new lines.

import { get } from "../api.js";
import { clear, h } from "../ui.js";

const POLL_MS = 1500;
const KEEP_LINES = 5000;

function lineEl(line) {
  const level = line.level ?? "info";
  if (!line.time) return h(`div.log-line.${level}`, { dataset: { level } }, line.text);
  return h(
    `div.log-line.${level}`,
    { dataset: { level } },
    h("span.time", line.time), " ",
    h("span.lvl", line.level.toUpperCase()), " ",
    h("span.logger", line.logger), " ",
    h("span.message", line.message),
  );
}

export async function render(view) {
  const level = h("select", { id: "log-level" }, ["debug", "info", "warning", "error"].map((l) => h("option", { value: l }, l)));
  const lines = h("select", { id: "log-lines" }, ["200", "500", "2000"].map((n) => h("option", { value: n }, `${n} lines`)));
  const follow = h("input", { type: "checkbox", id: "log-follow", checked: true });
  const search = h("input", { type: "search", placeholder: "Filter text…", id: "log-search" });
  const box = h("div.log-view", { id: "log-view" });
  const info = h("span.muted.small", { id: "log-info" });
  const state = { cursor: null, timer: null, stopped: false };

  const visible = (el) => !search.value || el.textContent.toLowerCase().includes(search.value.toLowerCase());
  const applySearch = () => box.querySelectorAll(".log-line").forEach((el) => (el.hidden = !visible(el)));

  function append(items) {
    const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
    for (const item of items) {
      const el = lineEl(item);
      el.hidden = !visible(el);
      box.append(el);
    }
    while (box.childElementCount > KEEP_LINES) box.firstElementChild.remove();
    if (atBottom || follow.checked) box.scrollTop = box.scrollHeight;
  }

  async function load() {
    const data = await get(`/logs?lines=${lines.value}&level=${level.value}`);
    clear(box);
    state.cursor = data.cursor;
    if (!data.exists) {
      box.append(h("div.empty", `No log file yet at ${data.path}. \`omlx serve\` writes it.`));
      info.textContent = "";
      return;
    }
    info.textContent = data.path;
    if (!data.lines.length) box.append(h("div.empty", "No lines at this level yet."));
    append(data.lines);
  }

  async function poll() {
    if (follow.checked && state.cursor !== null) {
      try {
        const data = await get(`/logs?lines=${KEEP_LINES}&level=${level.value}&after=${state.cursor}`);
        if (data.exists) {
          if (data.reset || box.querySelector(".empty")) clear(box);
          state.cursor = data.cursor;
          info.textContent = data.path;
          append(data.lines);
        }
      } catch (error) {
        console.warn("log poll failed:", error.message);
      }
    }
    if (!state.stopped) state.timer = setTimeout(poll, POLL_MS);
  }

  level.onchange = load;
  lines.onchange = load;
  search.oninput = applySearch;
  view.append(
    h(
      "div.stack",
      h(
        "div.card.row",
        { style: "padding:12px 16px" },
        h("label.row.small", { style: "gap:6px" }, "Level", level),
        lines,
        search,
        h("label.row.small", { style: "gap:6px" }, follow, "Follow"),
        h("span.spacer"),
        info,
      ),
      box,
    ),
  );
  await load();
  state.timer = setTimeout(poll, POLL_MS);
  return () => {
    state.stopped = true;
    clearTimeout(state.timer);
  };
}
