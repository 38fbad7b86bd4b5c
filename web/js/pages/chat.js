// Chat: streams /v1/chat/completions (the API clients use), markdown sanitized,
// reasoning folded, a stop button that aborts the fetch; images attach for vision models.

import DOMPurify from "../../vendor/dompurify/purify.es.js";
import { marked } from "../../vendor/marked/marked.esm.js";
import { ApiError, get, streamChat } from "../api.js";
import { clear, formatNumber, h, uid } from "../ui.js";
import { imageAttachments, messageContent, thumbnails } from "./chat_images.js";

function renderMarkdown(target, text) {
  target.innerHTML = DOMPurify.sanitize(marked.parse(text, { gfm: true, breaks: true }));
}

function bubble(role, text = "", images = []) {
  const content = h("div.content");
  const el = h(`div.msg.${role}`, { dataset: { role } }, h("div.role", role), content);
  if (role === "user") content.textContent = text;
  if (images.length) el.insertBefore(thumbnails(images), content);
  return { el, content };
}

export async function render(view, { params, navigate }) {
  const { models: all } = await get("/models");
  // Embedding and rerank models do not generate text.
  const models = all.filter((m) => m.kind === "llm" || m.kind === "vlm");
  const model = h("select", { id: uid(), name: "model" }, models.map((m) => h("option", { value: m.id }, m.id)));
  const wanted = params.get("model");
  if (wanted && models.some((m) => m.id === wanted)) model.value = wanted;
  const maxTokens = h("input", { type: "number", name: "max_tokens", value: "512", min: "1", style: "width:90px" });
  const temperature = h("input", { type: "number", name: "temperature", value: "0.7", step: "0.1", min: "0", max: "2", style: "width:80px" });
  const log = h("div.chat-log", { id: "chat-log" });
  const input = h("textarea", { id: "chat-input", rows: 2, placeholder: "Message… (Enter to send, Shift+Enter for a new line)" });
  const send = h("button.btn.primary", { id: "chat-send" }, "Send");
  const stop = h("button.btn.danger", { id: "chat-stop", hidden: true }, "Stop");
  const history = [];
  let controller = null;
  const attachments = imageAttachments();
  const takesImages = () => models.find((m) => m.id === model.value)?.capabilities?.includes("vision") ?? false;
  model.addEventListener("change", () => attachments.setEnabled(takesImages()));
  input.addEventListener("paste", (event) => attachments.onPaste(event));

  const reset = () => {
    controller?.abort();
    history.length = 0;
    clear(log, h("div.empty", { id: "chat-empty" }, models.length ? "Say something to start." : "No models yet: install one on the Models page."));
  };

  async function submit() {
    const text = input.value.trim();
    if (controller || !model.value || (!text && !attachments.count())) return;
    const images = attachments.take();
    input.value = "";
    log.querySelector("#chat-empty")?.remove();
    history.push({ role: "user", content: messageContent(text, images) });
    log.append(bubble("user", text, images).el);
    const reply = bubble("assistant");
    const reasoning = h("div.reasoning-text");
    const details = h("details.reasoning", { hidden: true }, h("summary", "Reasoning"), reasoning);
    const meta = h("div.meta");
    reply.el.insertBefore(details, reply.content);
    reply.el.append(meta);
    log.append(reply.el);
    let answer = "";
    let thought = "";
    let usage = null;
    const started = performance.now();
    controller = new AbortController();
    send.hidden = true;
    stop.hidden = false;
    reply.el.dataset.streaming = "true";
    try {
      await streamChat(
        {
          model: model.value,
          messages: history,
          max_tokens: Number(maxTokens.value) || undefined,
          temperature: Number(temperature.value),
          stream_options: { include_usage: true },
        },
        {
          signal: controller.signal,
          onChunk: (chunk) => {
            usage = chunk.usage ?? usage;
            const delta = chunk.choices?.[0]?.delta ?? {};
            if (delta.reasoning_content) {
              thought += delta.reasoning_content;
              details.hidden = false;
              reasoning.textContent = thought;
            }
            if (delta.content) {
              answer += delta.content;
              reply.el.dataset.chunks = String(Number(reply.el.dataset.chunks ?? 0) + 1);
              renderMarkdown(reply.content, answer);
              log.scrollTop = log.scrollHeight;
            }
          },
        },
      );
      history.push({ role: "assistant", content: answer });
      const seconds = (performance.now() - started) / 1000;
      meta.textContent = usage
        ? `${usage.completion_tokens} tokens · ${formatNumber(usage.completion_tokens / seconds, 1)} tok/s`
        : `${seconds.toFixed(1)} s`;
    } catch (error) {
      if (error.name === "AbortError") {
        meta.textContent = "stopped";
        if (answer) history.push({ role: "assistant", content: answer });
      } else {
        reply.el.classList.add("error");
        const hint = error instanceof ApiError && error.status === 401 ? " Log in again to chat." : "";
        reply.content.textContent = error.message + hint;
        history.pop();
      }
    } finally {
      delete reply.el.dataset.streaming;
      reply.el.dataset.done = "true";
      controller = null;
      send.hidden = false;
      stop.hidden = true;
      input.focus();
    }
  }

  send.onclick = submit;
  stop.onclick = () => controller?.abort();
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      submit();
    }
  });
  view.append(
    h(
      "div.chat",
      h(
        "div.card.row",
        { style: "padding:12px 16px" },
        h("label.row.small", { style: "gap:6px" }, "Model", model),
        h("label.row.small", { style: "gap:6px" }, "Max tokens", maxTokens),
        h("label.row.small", { style: "gap:6px" }, "Temperature", temperature),
        h("span.spacer"),
        h("button.btn.ghost", { onclick: () => navigate("models") }, "Models"),
        h("button.btn", { onclick: reset }, "New chat"),
      ),
      log,
      attachments.strip,
      attachments.notice,
      h("div.chat-input", ...attachments.elements, input, send, stop),
    ),
  );
  reset();
  attachments.setEnabled(takesImages());
  input.focus();
  return () => controller?.abort();
}
