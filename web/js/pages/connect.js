// Connect: point a coding agent or chat app at this server. The same settings
// `omlx launch claude|codex|opencode` puts in the tool's environment.

import { get } from "../api.js";
import { clear, h, toast } from "../ui.js";

const TITLES = { claude: "Claude Code", codex: "Codex CLI", opencode: "opencode" };

async function copy(text) {
  try {
    await navigator.clipboard.writeText(text);
    toast("Copied");
  } catch {
    toast("Select the text and copy it (the clipboard is not available here)", "warn");
  }
}

function block(id, text) {
  return h("div.copy-block", h(`pre.mono#${id}`, text), h("button.btn.small", { type: "button", onclick: () => copy(text) }, "Copy"));
}

function toolCard(tool) {
  return h(`section.card#connect-${tool.tool}`,
    h("div.card-head", h("h2", TITLES[tool.tool] ?? tool.tool), h("span.hint", `Install: ${tool.install}`)),
    tool.warning ? h(`p.notice.warn#context-warning-${tool.tool}`, tool.warning) : null,
    h("p", "Start it from a terminal with everything set:"),
    block(`launch-${tool.tool}`, tool.launch),
    h("p", "Or set these yourself:"),
    block(`shell-${tool.tool}`, tool.shell),
  );
}

export async function render(view) {
  const picker = h("select#connect-model");
  const body = h("div#connect-body");

  async function load(model) {
    const data = await get(model ? `/connect?model=${encodeURIComponent(model)}` : "/connect");
    clear(picker, data.models.map((m) => h("option", { value: m, selected: m === data.model }, m)));
    const key = data.api_key_required ? "your omlx API key" : "any non-empty key (none is set)";
    clear(body,
      h("section.card#connect-api",
        h("div.card-head", h("h2", "Any OpenAI, Anthropic or Ollama client")),
        h("p", "OpenAI base URL:"), block("openai-base-url", data.openai_base_url),
        h("p", "Anthropic and Ollama base URL:"), block("base-url", data.base_url),
        h("p", `Key: ${key}. Model: ${data.model}` +
          (data.context_window ? ` (context window ${data.context_window.toLocaleString("en-US")} tokens).` : ".")),
      ),
      data.tools.map(toolCard),
    );
  }

  picker.addEventListener("change", () => load(picker.value));
  view.append(h("div.connect-toolbar", h("label", { for: "connect-model" }, "Model "), picker), body);
  await load(null);
}
