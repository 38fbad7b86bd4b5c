"""What Ollama's model routes tell about a model folder: /api/tags entries,
/api/show's details, model_info and capabilities, /api/ps entries.

Read from the folder's config.json and tokenizer files (small; read off the
event loop by the routes), never from loaded weights.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from omlx.api.ollama_format import ollama_name
from omlx.cache.safetensors_io import SafetensorsFormatError, read_header
from omlx.models.discovery import ModelInfo
from omlx.models.loader import native_context_length
from omlx.settings import SamplingSettings

# Ollama's names of unquantized weight types, by config.json's torch_dtype.
_DTYPE_NAMES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
_FLOAT_DTYPES = frozenset(_DTYPE_NAMES.values())
# Ollama's parameter names for our sampling defaults.
_PARAMETERS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repeat_penalty",
}
# What /api/ps shows for a model that never expires (Ollama shows a far date too).
NEVER = datetime(9999, 12, 31, tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class ModelFacts:
    info: ModelInfo
    public_name: str
    config: dict[str, Any]
    chat_template: str
    # From the safetensors headers: parameters, and the floating dtype ("BF16"...).
    parameter_count: int
    weights_dtype: str | None

    def details(self) -> dict[str, Any]:
        family = self.info.model_type
        bits = quant_bits(self.config)
        if bits is not None:
            level = f"Q{bits}"  # MLX affine quantization
        else:
            torch_dtype = str(self.config.get("torch_dtype"))
            level = self.weights_dtype or _DTYPE_NAMES.get(torch_dtype, "F16")
        return {
            "parent_model": "",
            "format": "safetensors",
            "family": family,
            "families": [family],
            "parameter_size": _parameter_size(self.parameter_count),
            "quantization_level": level,
        }

    def digest(self) -> str:
        """Changes when the folder's config or weights change (Ollama's is a sha256)."""
        stamp = f"{self.info.path}|{self.info.size_bytes}|{self.modified_at().isoformat()}"
        return hashlib.sha256(stamp.encode() + json.dumps(self.config).encode()).hexdigest()

    def modified_at(self) -> datetime:
        return datetime.fromtimestamp(self.info.path.stat().st_mtime, UTC)

    def capabilities(self) -> list[str]:
        if self.info.kind == "embedding":
            return ["embedding"]
        # Tools work with any chat template: omlx writes them in when it does not.
        caps = ["completion", "tools"] if self.chat_template else ["completion"]
        if "enable_thinking" in self.chat_template or "<think>" in self.chat_template:
            caps.append("thinking")
        if self.info.kind == "vlm":
            caps.append("vision")  # Ollama's word for a model that takes images
        return caps

    def model_info(self) -> dict[str, Any]:
        arch, config = self.info.model_type, self.config
        info: dict[str, Any] = {
            "general.architecture": arch,
            "general.parameter_count": self.parameter_count,
        }
        fields = {
            "context_length": native_context_length(config),
            "embedding_length": config.get("hidden_size"),
            "block_count": config.get("num_hidden_layers"),
            "attention.head_count": config.get("num_attention_heads"),
            "attention.head_count_kv": config.get("num_key_value_heads"),
            "vocab_size": config.get("vocab_size"),
        }
        info.update({f"{arch}.{k}": v for k, v in fields.items() if v is not None})
        return info


def read_facts(info: ModelInfo, public_name: str) -> ModelFacts:
    """The facts of one model folder (blocking file reads)."""
    config = _json(info.path / "config.json")
    count, dtype = _tensor_facts(info.path, quant_bits(config))
    return ModelFacts(info, public_name, config, _chat_template(info.path), count, dtype)


def quant_bits(config: dict[str, Any]) -> int | None:
    quant = config.get("quantization") or config.get("quantization_config")
    bits = quant.get("bits") if isinstance(quant, dict) else None
    return bits if isinstance(bits, int) and bits > 0 else None


def _tensor_facts(folder: Path, bits: int | None) -> tuple[int, str | None]:
    """(parameters, the weights' floating dtype) from the safetensors headers only;
    a packed uint32 of a quantized weight holds ``32 / bits`` parameters."""
    count, dtype = 0, None
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with file.open("rb") as f:
                entries, _, _ = read_header(f, file.stat().st_size)
        except (OSError, SafetensorsFormatError):
            return 0, None
        for name, entry in entries.items():
            if name.endswith((".scales", ".biases")):
                continue  # quantization constants, not parameters
            num = math.prod(entry["shape"])
            if entry["dtype"] == "U32" and bits:
                num = num * 32 // bits
            elif dtype is None and entry["dtype"] in _FLOAT_DTYPES:
                dtype = entry["dtype"]
            count += num
    return count, dtype


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _chat_template(folder: Path) -> str:
    try:
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    except OSError:
        template = _json(folder / "tokenizer_config.json").get("chat_template")
        return template if isinstance(template, str) else ""


def _parameter_size(count: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.1f}{suffix}"
    return str(count)


def tags_entry(facts: ModelFacts) -> dict[str, Any]:
    name = ollama_name(facts.public_name)
    return {
        "name": name,
        "model": name,
        "modified_at": facts.modified_at().isoformat(),
        "size": facts.info.size_bytes,
        "digest": facts.digest(),
        "details": facts.details(),
    }


def show_body(facts: ModelFacts, sampling: SamplingSettings) -> dict[str, Any]:
    parameters = "\n".join(
        f"{ollama} {getattr(sampling, ours)}" for ours, ollama in _PARAMETERS.items()
    )
    return {
        "modelfile": f"# served by omlx from a model folder\nFROM {facts.info.path}\n",
        "parameters": parameters,
        "template": facts.chat_template,
        "details": facts.details(),
        "model_info": facts.model_info(),
        "capabilities": facts.capabilities(),
        "modified_at": facts.modified_at().isoformat(),
    }


def ps_entry(
    facts: ModelFacts, memory_bytes: int, expires_in_s: float | None, context_length: int
) -> dict[str, Any]:
    if expires_in_s is None:
        expires_at = NEVER
    else:
        expires_at = datetime.now(UTC) + timedelta(seconds=expires_in_s)
    return {
        **tags_entry(facts),
        "size": memory_bytes,
        # Apple Silicon's memory is unified: all of it is the GPU's.
        "size_vram": memory_bytes,
        "expires_at": expires_at.isoformat(),
        "context_length": context_length,
    }
