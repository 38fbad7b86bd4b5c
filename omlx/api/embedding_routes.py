"""/v1/embeddings (OpenAI) and /v1/rerank (Cohere / Jina, as Open WebUI and
LlamaIndex call it), served by embedding and cross-encoder models."""

from __future__ import annotations

import asyncio
import base64
import logging
import time
import uuid
from typing import Any, cast

import numpy as np
from fastapi import APIRouter, Request

from omlx.api.embedding_schemas import EmbeddingsRequest, RerankRequest
from omlx.api.state import state_of
from omlx.embeddings.engine import EmbeddingEngine
from omlx.embeddings.inputs import (
    Sequence,
    check_total,
    pair_sequences,
    text_sequences,
    token_sequences,
)
from omlx.embeddings.llm_rerank import llm_pair_sequences
from omlx.errors import InvalidRequestError, WrongModelKindError

log = logging.getLogger(__name__)
router = APIRouter()
_LLM_RERANK_HINT = (
    "; an LLM reranker (Qwen3-Reranker style) is served as kind rerank when its folder "
    "name contains 'reranker' or its per-model setting says model_type 'rerank'"
)


def _sequences(engine: EmbeddingEngine, body: EmbeddingsRequest) -> list[Sequence]:
    data = [body.input] if isinstance(body.input, str) else body.input
    limit, cut = engine.loaded.spec.max_tokens, body.truncate
    if data and all(isinstance(x, str) for x in data):
        texts = cast(list[str], data)
        return text_sequences(engine.tokenizer, texts, limit, truncate=cut, field="input")
    # Token ids: one list of ints is one input; a list of lists is many.
    lists = cast(list[list[int]], [data] if data and isinstance(data[0], int) else data)
    vocab = int(engine.loaded.config.get("vocab_size") or 0)
    return token_sequences(lists, limit, vocab, truncate=cut, field="input")


def fit_dimensions(vectors: np.ndarray, engine: EmbeddingEngine, wanted: int | None) -> np.ndarray:
    """``dimensions``: Matryoshka models keep the first ``wanted`` values, re-normalised."""
    full = vectors.shape[1]
    if wanted is None or wanted == full:
        return vectors
    spec = engine.loaded.spec
    if not spec.truncate_dims:
        raise InvalidRequestError(
            f"'dimensions' cannot be {wanted}: model '{engine.name}' gives {full}-dimensional "
            "vectors and was not trained to be truncated (no matryoshka_dims); omit the field",
            param="dimensions",
        )
    if wanted > full:
        raise InvalidRequestError(
            f"'dimensions' must be at most {full} for model '{engine.name}'", param="dimensions"
        )
    cut = vectors[:, :wanted]
    unit: np.ndarray = cut / np.maximum(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12)
    return unit


def _encode(row: np.ndarray, fmt: str) -> list[float] | str:
    if fmt == "base64":  # little-endian float32, as OpenAI sends it
        return base64.b64encode(row.astype("<f4").tobytes()).decode("ascii")
    return [float(x) for x in row]


async def run_embedding(engine: EmbeddingEngine, sequences: list[Sequence]) -> np.ndarray:
    """Submit and wait; a client that goes away cancels what has not run yet."""
    future = engine.submit(sequences)
    try:
        return await asyncio.wrap_future(future)
    except asyncio.CancelledError:
        future.cancel()
        raise


@router.post("/v1/embeddings")
async def create_embeddings(body: EmbeddingsRequest, request: Request) -> dict[str, Any]:
    pool = state_of(request).pool
    start = time.perf_counter()
    async with pool.lease(body.model, kind="embedding") as engine:
        sequences = _sequences(engine, body)
        tokens = check_total(sequences, "input")
        vectors = fit_dimensions(await run_embedding(engine, sequences), engine, body.dimensions)
    log.info(
        "embeddings %s: %d inputs, %d tokens in %.3f s",
        engine.name,
        len(sequences),
        tokens,
        time.perf_counter() - start,
    )
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": _encode(row, body.encoding_format)}
            for i, row in enumerate(vectors)
        ],
        "model": pool.public_name(engine.name),
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


async def _scores(engine: EmbeddingEngine, body: RerankRequest) -> tuple[np.ndarray, int, str]:
    """Relevance of each document: an LLM reranker's P(yes), a cross-encoder's score
    of the (query, document) pair, else the cosine similarity of their embeddings."""
    limit, texts = engine.loaded.spec.max_tokens, body.texts()
    prompt = engine.loaded.rerank_prompt
    if prompt is not None:
        pairs = llm_pair_sequences(
            engine.tokenizer, prompt, body.query, texts, body.instruction, limit,
            truncate=body.truncate,
        )  # fmt: skip
        return await run_embedding(engine, pairs), check_total(pairs, "documents"), "llm-yes-no"
    if engine.loaded.spec.cross_encoder:
        pairs = pair_sequences(engine.tokenizer, body.query, texts, limit, truncate=body.truncate)
        return await run_embedding(engine, pairs), check_total(pairs, "documents"), "cross-encoder"
    tok, cut = engine.tokenizer, body.truncate
    query = text_sequences(tok, [body.query], limit, truncate=cut, field="query")
    docs = text_sequences(tok, texts, limit, truncate=cut, field="documents")
    tokens = check_total(query + docs, "documents")
    vectors = await run_embedding(engine, query + docs)
    unit = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    return unit[1:] @ unit[0], tokens, "embedding-cosine"


async def _rerank(body: RerankRequest, request: Request) -> dict[str, Any]:
    pool = state_of(request).pool
    info = pool.resolve(body.model)
    if info.kind not in ("embedding", "rerank"):
        raise WrongModelKindError(
            pool.public_name(info.name), info.kind, "embedding or rerank", hint=_LLM_RERANK_HINT
        )
    async with pool.lease(body.model, kind=info.kind) as engine:
        scores, tokens, method = await _scores(engine, body)
    order = sorted(range(len(scores)), key=lambda i: -float(scores[i]))[: body.top_n]
    texts = body.texts()
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": float(scores[i])}
        if body.return_documents:
            result["document"] = {"text": texts[i]}
        results.append(result)
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "object": "rerank",
        "model": pool.public_name(engine.name),
        "results": results,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "meta": {"method": method, "billed_units": {"search_units": 1}},
    }


@router.post("/v1/rerank")
async def rerank(body: RerankRequest, request: Request) -> dict[str, Any]:
    return await _rerank(body, request)


# Cohere's v2 path, for clients that append it to a base URL.
@router.post("/v2/rerank")
async def rerank_v2(body: RerankRequest, request: Request) -> dict[str, Any]:
    return await _rerank(body, request)
