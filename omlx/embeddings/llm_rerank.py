"""LLM rerankers (Qwen3-Reranker style): a causal LM asked whether a document meets
the query, scored by its "yes" against its "no" at the prompt's last position.

The prompt is the one Qwen3-Reranker's model card formats: a fixed system turn, the
user turn ``<Instruct>: ...\\n<Query>: ...\\n<Document>: ...`` and an assistant turn
whose empty think block is closed. The relevance score is softmax([no, yes])[yes].
The sequence building is pure; ``YesNoHead`` runs on the MLX thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omlx.embeddings.inputs import Sequence, check_count, check_length

PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the "
    'Query and the Instruct provided. Note that the answer can only be "yes" or "no".'
    "<|im_end|>\n<|im_start|>user\n"
)
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


@dataclass(frozen=True, slots=True)
class RerankPrompt:
    """The token ids around each (query, document) body, and the two answer tokens."""

    prefix_ids: list[int]
    suffix_ids: list[int]
    yes_id: int
    no_id: int


def rerank_prompt(tokenizer: Any) -> RerankPrompt:
    """The model's prompt pieces; ValueError when its vocabulary lacks "yes" or "no"."""
    yes_id, no_id = tokenizer.token_to_id("yes"), tokenizer.token_to_id("no")
    if yes_id is None or no_id is None:
        raise ValueError(
            'an LLM reranker scores the tokens "yes" and "no", and this tokenizer has no '
            "such tokens"
        )
    prefix = tokenizer.encode(PREFIX, add_special_tokens=False).ids
    suffix = tokenizer.encode(SUFFIX, add_special_tokens=False).ids
    return RerankPrompt(prefix, suffix, yes_id, no_id)


def body_text(query: str, document: str, instruction: str | None) -> str:
    return (
        f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n"
        f"<Document>: {document}"
    )


def llm_pair_sequences(
    tokenizer: Any,
    prompt: RerankPrompt,
    query: str,
    documents: list[str],
    instruction: str | None,
    limit: int,
    *,
    truncate: bool,
) -> list[Sequence]:
    """One full prompt per document; truncation cuts the body's end (the document),
    keeping the closing turn whose last position is scored."""
    check_count(len(documents), "documents")
    bodies = [body_text(query, d, instruction) for d in documents]
    room = limit - len(prompt.prefix_ids) - len(prompt.suffix_ids)
    out = []
    for i, enc in enumerate(tokenizer.encode_batch(bodies, add_special_tokens=False)):
        total = len(prompt.prefix_ids) + len(enc.ids) + len(prompt.suffix_ids)
        check_length(total, limit, f"documents[{i}]", truncate)
        ids = prompt.prefix_ids + enc.ids[: max(room, 0)] + prompt.suffix_ids
        out.append(Sequence(ids, [0] * len(ids)))
    return out


class YesNoHead:
    """mlx-lm's output projection at each row's last real token, cut to [no, yes]:
    the engine's two-class score (softmax, last class) is then P(yes)."""

    def __init__(self, model: Any, prompt: RerankPrompt):
        self.model = model
        self.ids = [prompt.no_id, prompt.yes_id]

    def parameters(self) -> Any:
        return {}  # the projection's weights are counted with the encoder (same model)

    def __call__(self, hidden: Any, attention: Any) -> Any:
        import mlx.core as mx

        last = attention.astype(mx.int32).sum(axis=1) - 1  # right padding
        final = mx.take_along_axis(hidden, last[:, None, None], axis=1)
        lm_head = getattr(self.model, "lm_head", None)
        if lm_head is not None:
            logits = lm_head(final)
        else:  # tied embeddings
            logits = self.model.model.embed_tokens.as_linear(final)
        return logits[:, 0, self.ids].astype(mx.float32)
