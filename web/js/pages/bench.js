// Benchmark, run from the browser against /v1: prefill and decode tok/s at a few
// prompt lengths, and aggregate decode tok/s at several concurrent streams.

import { get, streamChat } from "../api.js";
import { clear, formatNumber, h, toast } from "../ui.js";

const WORDS = "river stone light cloud paper garden window silver morning orange table music forest quiet yellow bridge".split(" ");

/** A prompt of about ``n`` tokens, with a fresh nonce so the prefix cache cannot answer it. */
function promptOf(n) {
  const nonce = Math.random().toString(36).slice(2, 10);
  const words = [`${nonce}:`];
  for (let i = 0; i < n - 8; i += 1) words.push(WORDS[(i * 7 + nonce.charCodeAt(0)) % WORDS.length]);
  return `${words.join(" ")}\nContinue the list.`;
}

function parseList(text, fallback) {
  const values = text.split(/[ ,]+/).map(Number).filter((v) => Number.isInteger(v) && v > 0);
  return values.length ? values : fallback;
}

/** One streamed request; times from send to first token and to the end. */
async function timedStream(model, promptTokens, maxTokens, signal) {
  const started = performance.now();
  let first = null;
  let usage = null;
  await streamChat(
    {
      model,
      messages: [{ role: "user", content: promptOf(promptTokens) }],
      max_tokens: maxTokens,
      temperature: 0,
      ignore_eos: true,
      stream_options: { include_usage: true },
    },
    {
      signal,
      onChunk: (chunk) => {
        usage = chunk.usage ?? usage;
        if (first === null && chunk.choices?.[0]?.delta?.content) first = performance.now();
      },
    },
  );
  const ended = performance.now();
  first ??= ended;
  return { started, first, ended, usage: usage ?? { prompt_tokens: promptTokens, completion_tokens: 0 } };
}

function single(r) {
  const ttft = (r.first - r.started) / 1000;
  const decodeS = (r.ended - r.first) / 1000;
  const generated = r.usage.completion_tokens;
  return {
    ttft,
    prefill: r.usage.prompt_tokens / ttft,
    decode: generated > 1 && decodeS > 0 ? (generated - 1) / decodeS : null,
  };
}

export async function render(view) {
  const { models: all } = await get("/models");
  // Embedding and rerank models do not generate text.
  const models = all.filter((m) => m.kind === "llm" || m.kind === "vlm");
  const model = h("select", { id: "bench-model" }, models.map((m) => h("option", { value: m.id }, m.id)));
  const lengths = h("input", { id: "bench-lengths", value: "128, 512, 2048" });
  const decodeTokens = h("input", { id: "bench-tokens", type: "number", value: "64", min: "2" });
  const concurrency = h("input", { id: "bench-concurrency", value: "1, 4, 8" });
  const run = h("button.btn.primary", { id: "bench-run" }, "Run benchmark");
  const stop = h("button.btn.danger", { hidden: true }, "Stop");
  const status = h("span.muted.small", { id: "bench-status" });
  const rows = h("tbody", { id: "bench-rows" });
  let controller = null;

  const addRow = (cells) => rows.append(h("tr", cells.map((c) => h("td", c))));

  async function benchmark() {
    controller = new AbortController();
    const signal = controller.signal;
    const maxTokens = Math.max(2, Number(decodeTokens.value) || 64);
    clear(rows);
    run.hidden = true;
    stop.hidden = false;
    try {
      status.textContent = "warming up…";
      await timedStream(model.value, 16, 2, signal);
      for (const n of parseList(lengths.value, [128, 512, 2048])) {
        status.textContent = `prompt of ${n} tokens…`;
        const r = await timedStream(model.value, n, maxTokens, signal);
        const s = single(r);
        addRow(["single", formatNumber(r.usage.prompt_tokens), "1", `${formatNumber(s.ttft * 1000)} ms`, formatNumber(s.prefill, 1), formatNumber(s.decode, 1), "–"]);
      }
      for (const c of parseList(concurrency.value, [1, 4, 8])) {
        status.textContent = `${c} concurrent streams…`;
        const started = performance.now();
        const results = await Promise.all(Array.from({ length: c }, () => timedStream(model.value, 64, maxTokens, signal)));
        const wall = (performance.now() - started) / 1000;
        const tokens = results.reduce((n, r) => n + r.usage.completion_tokens, 0);
        const decode = results.map(single).map((s) => s.decode ?? 0);
        addRow(["concurrent", "64", String(c), `${formatNumber((results.reduce((t, r) => t + (r.first - r.started), 0) / c))} ms`, "–", formatNumber(decode.reduce((a, b) => a + b, 0) / c, 1), formatNumber(tokens / wall, 1)]);
      }
      status.textContent = "done";
    } catch (error) {
      status.textContent = error.name === "AbortError" ? "stopped" : "";
      if (error.name !== "AbortError") toast(error.message, "err");
    } finally {
      controller = null;
      run.hidden = false;
      stop.hidden = true;
    }
  }

  run.onclick = benchmark;
  stop.onclick = () => controller?.abort();
  view.append(
    h(
      "div.stack",
      h(
        "div.card",
        h("div.card-head", h("h2", "Run"), h("span.hint", "Prompts carry a random prefix, so the prefix cache does not help.")),
        h(
          "div.fields",
          h("div.field", h("label", "Model"), model),
          h("div.field", h("label", "Prompt lengths (tokens)"), lengths),
          h("div.field", h("label", "Tokens to generate"), decodeTokens),
          h("div.field", h("label", "Concurrent streams"), concurrency),
        ),
        h("div.row", { style: "margin-top:16px" }, run, stop, status),
      ),
      h(
        "div.card",
        h("div.card-head", h("h2", "Results"), h("span.hint", "tok/s per stream; aggregate = all streams together")),
        h(
          "div.table-wrap",
          h(
            "table.table#bench-table",
            h("thead", h("tr", ["Run", "Prompt tokens", "Streams", "Time to first token", "Prefill tok/s", "Decode tok/s", "Aggregate tok/s"].map((t) => h("th", t)))),
            rows,
          ),
        ),
      ),
    ),
  );
  return () => controller?.abort();
}
