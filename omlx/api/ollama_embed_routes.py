"""Ollama's embedding routes: ``POST /api/embed`` (``input``: a string or a list,
unit-length vectors, long inputs cut unless ``"truncate": false``) and the older
``POST /api/embeddings`` (one ``prompt``, the model's own vector)."""

from __future__ import annotations

import time
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, Strict, StrictBool, StrictStr

from omlx.api.embedding_routes import fit_dimensions, run_embedding
from omlx.api.ollama_format import keep_alive_s, ollama_name, omlx_name
from omlx.api.state import state_of
from omlx.embeddings.inputs import check_total, text_sequences

router = APIRouter()
KeepAlive = Annotated[float, Strict()] | str


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # options and other fields are ignored

    model: str = Field(min_length=1)
    keep_alive: KeepAlive | None = None


class EmbedRequest(_Body):
    input: StrictStr | list[StrictStr]
    truncate: StrictBool = True  # Ollama's default: cut, not refuse
    dimensions: int | None = Field(default=None, ge=1)


class LegacyEmbeddingsRequest(_Body):
    prompt: StrictStr


async def _embed(
    request: Request, body: _Body, texts: list[str], *, truncate: bool, dimensions: int | None
) -> tuple[np.ndarray, int, str]:
    """(vectors, tokens, the model's Ollama name); keep_alive applied as chat does."""
    pool = state_of(request).pool
    ttl_s = keep_alive_s(body.keep_alive)
    name = pool.resolve(omlx_name(body.model)).name
    async with pool.lease(name, kind="embedding") as engine:
        pool.keep_alive(name, ttl_s)
        limit = engine.loaded.spec.max_tokens
        sequences = text_sequences(engine.tokenizer, texts, limit, truncate=truncate, field="input")
        tokens = check_total(sequences, "input")
        vectors = fit_dimensions(await run_embedding(engine, sequences), engine, dimensions)
    pool.keep_alive(name, ttl_s)  # counted from the end of the request, as Ollama does
    return vectors, tokens, ollama_name(pool.public_name(name))


@router.post("/api/embed")
async def embed(body: EmbedRequest, request: Request) -> dict[str, Any]:
    start = time.perf_counter_ns()
    texts = [body.input] if isinstance(body.input, str) else body.input
    vectors, tokens, model = await _embed(
        request, body, texts, truncate=body.truncate, dimensions=body.dimensions
    )
    unit = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    return {
        "model": model,
        "embeddings": unit.tolist(),
        "total_duration": time.perf_counter_ns() - start,
        "load_duration": 0,
        "prompt_eval_count": tokens,
    }


@router.post("/api/embeddings")
async def embeddings(body: LegacyEmbeddingsRequest, request: Request) -> dict[str, Any]:
    vectors, _, _ = await _embed(request, body, [body.prompt], truncate=True, dimensions=None)
    return {"embedding": vectors[0].tolist()}
