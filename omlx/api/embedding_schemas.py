"""Request bodies of /v1/embeddings (OpenAI) and /v1/rerank (Cohere / Jina)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr


class _Body(BaseModel):
    # Unknown fields are accepted and ignored, as clients send many.
    model_config = ConfigDict(extra="allow")


class EmbeddingsRequest(_Body):
    model: str = Field(min_length=1)
    # A string, a list of strings, one list of token ids, or a list of them.
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    # omlx: cut inputs longer than the model takes instead of answering 400.
    truncate: StrictBool = False


class RerankDocument(_Body):
    text: StrictStr


class RerankRequest(_Body):
    model: str = Field(min_length=1)
    query: StrictStr = Field(min_length=1)
    documents: list[StrictStr | RerankDocument]
    top_n: int | None = Field(default=None, ge=1)
    return_documents: StrictBool = False
    truncate: StrictBool = False
    # omlx: an LLM reranker's task instruction (Qwen3-Reranker's <Instruct>).
    instruction: StrictStr | None = Field(default=None, min_length=1)

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]
