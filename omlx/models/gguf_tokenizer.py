"""Rebuild a Hugging Face tokenizer from a GGUF file's ``tokenizer.ggml.*`` metadata.

Byte-level BPE (``tokenizer.ggml.model == "gpt2"``): tokens and merges are
stored verbatim, so the rebuilt tokenizer is exact once the pre-tokenizer
(``tokenizer.ggml.pre``) is mapped to what llama.cpp runs.

SentencePiece (``"llama"``: Llama 1/2, Mistral, Gemma, Phi-3): transformers'
GGUF tokenizer conversion rebuilds it (BPE with byte fallback, merges
recovered from the scores, Gemma's and Phi-3's quirks).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from omlx.errors import ImportFailedError
from omlx.models.gguf_reader import as_bool, as_int, as_int_array, as_str, as_str_list

log = logging.getLogger(__name__)

# llama.cpp token types (tokenizer.ggml.token_type).
_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre values llama.cpp splits with the GPT-2 regex, and those
# that first isolate every digit (StarCoder-style, SmolLM's tokenizer).
_GPT2_PRE = ("default", "gpt2", "mpt", "olmo")
_DIGITS_PRE = ("smollm", "starcoder", "refact", "codeshell")
_LLAMA3_PRE = ("llama-bpe", "llama3")
SUPPORTED_PRE = _GPT2_PRE + _DIGITS_PRE + _LLAMA3_PRE


@dataclass(frozen=True, slots=True)
class ImportedTokenizer:
    tokenizer: Tokenizer
    tokenizer_config: dict[str, Any]
    special_tokens_map: dict[str, str]
    bos_token_id: int | None
    eos_token_ids: list[int]

    def save(self, folder: Path) -> None:
        self.tokenizer.save(str(folder / "tokenizer.json"))
        _write_json(folder / "tokenizer_config.json", self.tokenizer_config)
        _write_json(folder / "special_tokens_map.json", self.special_tokens_map)


def build_tokenizer(
    metadata: dict[str, Any], *, model_max_length: int, arch: str = "llama"
) -> ImportedTokenizer:
    """Tokenizer plus its config files; unsupported or missing pieces raise ImportFailedError."""
    kind = _tokenizer_model(metadata)
    tokens = as_str_list(_TOKENS, _required(metadata, _TOKENS))
    if kind == "gpt2":
        merges = as_str_list(_MERGES, _required(metadata, _MERGES))
        tokenizer = _bpe_tokenizer(tokens, merges, as_str(_PRE, metadata.get(_PRE, "default")))
    else:
        tokenizer = _sentencepiece_tokenizer(metadata, tokens, arch)
    _add_special_tokens(tokenizer, tokens, metadata.get(_TOKEN_TYPE))

    ids = _special_ids(metadata, len(tokens))
    names = {role: tokens[i] for role, i in ids.items() if i is not None}
    # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
    add_bos = as_bool(_ADD_BOS, metadata.get(_ADD_BOS, kind == "llama"))
    add_eos = as_bool(_ADD_EOS, metadata.get(_ADD_EOS, False))
    processor = _post_processor(names, ids, add_bos=add_bos, add_eos=add_eos)
    if processor is None and kind == "gpt2":
        processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.post_processor = processor  # replaces transformers' default "<s>" template

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{f"{role}_token": name for role, name in names.items() if role in _ROLES},
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    if template := as_str(_TEMPLATE, metadata.get(_TEMPLATE, "")):
        config["chat_template"] = template
    special_map = {f"{role}_token": name for role, name in names.items() if role in _ROLES}
    eos_ids = [i for role in ("eos", "eot", "eom") if (i := ids[role]) is not None]
    return ImportedTokenizer(
        tokenizer, config, special_map, ids["bos"], list(dict.fromkeys(eos_ids))
    )


def _tokenizer_model(metadata: dict[str, Any]) -> str:
    kind = metadata.get("tokenizer.ggml.model")
    if not isinstance(kind, str) or kind not in ("gpt2", "llama"):
        shown = repr(kind) if isinstance(kind, str | None) else "(not a string)"
        raise ImportFailedError(
            f"tokenizer model {shown} is not supported: byte-level BPE ('gpt2') and "
            "SentencePiece ('llama') tokenizers can be imported"
        )
    return kind


_TOKENS, _MERGES, _PRE = "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.pre"
_TOKEN_TYPE, _TEMPLATE = "tokenizer.ggml.token_type", "tokenizer.chat_template"
_SCORES, _SPACE_PREFIX = "tokenizer.ggml.scores", "tokenizer.ggml.add_space_prefix"
_ADD_BOS, _ADD_EOS = "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token"
_ROLES = ("bos", "eos", "unk", "pad")
_ID_KEYS = {
    "bos": "bos_token_id",
    "eos": "eos_token_id",
    "unk": "unknown_token_id",
    "pad": "padding_token_id",
    # End of turn / end of message: chat models stop on these too.
    "eot": "eot_token_id",
    "eom": "eom_token_id",
}


def _required(metadata: dict[str, Any], key: str) -> Any:
    if key not in metadata:
        raise ImportFailedError(f"the GGUF has no {key}: its tokenizer cannot be rebuilt")
    return metadata[key]


def _special_ids(metadata: dict[str, Any], vocab_size: int) -> dict[str, int | None]:
    ids: dict[str, int | None] = {}
    for role, key in _ID_KEYS.items():
        value = metadata.get(f"tokenizer.ggml.{key}")
        if value is not None:
            value = as_int(f"tokenizer.ggml.{key}", value)
            if value >= vocab_size:
                raise ImportFailedError(f"tokenizer.ggml.{key} = {value} is outside the vocabulary")
        ids[role] = value
    return ids


def _bpe_tokenizer(tokens: list[str], merges: list[str], pre: str) -> Tokenizer:
    if pre not in SUPPORTED_PRE:
        raise ImportFailedError(
            f"pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; "
            f"supported: {', '.join(SUPPORTED_PRE)}"
        )
    if pre == "default":
        log.warning("GGUF names no pre-tokenizer; using GPT-2's split (as llama.cpp warns)")
    # The first id wins when a token string repeats (some vocabularies pad with duplicates).
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    pairs = [_merge_pair(m) for m in merges]
    try:
        # Llama 3's tokenizer takes whole words found in the vocab before merging.
        bpe = models.BPE(vocab, pairs, ignore_merges=pre in _LLAMA3_PRE)
    except Exception as exc:  # tokenizers raises plain Exception, e.g. a merge of unknown tokens
        raise ImportFailedError(f"the GGUF's BPE tokenizer is invalid: {exc}") from exc
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_tokenizer(metadata: dict[str, Any], tokens: list[str], arch: str) -> Tokenizer:
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    scores = metadata.get(_SCORES)
    if scores is None or not hasattr(scores, "__len__") or len(scores) != len(tokens):
        raise ImportFailedError(
            f"{_SCORES} must give one score per token: a SentencePiece vocabulary "
            "cannot be rebuilt without them"
        )
    fields = {"tokenizer_type": "llama", "tokens": tokens, "scores": list(map(float, scores))}
    if _TOKEN_TYPE in metadata:
        fields["token_type"] = as_int_array(_TOKEN_TYPE, metadata[_TOKEN_TYPE]).tolist()
    if _MERGES in metadata:
        fields["merges"] = as_str_list(_MERGES, metadata[_MERGES])
    try:
        tokenizer, _ = convert_gguf_tokenizer(arch, fields)
    except Exception as exc:  # transformers/tokenizers raise plain Exception on a bad vocabulary
        raise ImportFailedError(f"the GGUF's SentencePiece tokenizer is invalid: {exc}") from exc
    if not arch.startswith("gemma"):  # transformers' Gemma builder has Gemma's own rules
        space_prefix = as_bool(_SPACE_PREFIX, metadata.get(_SPACE_PREFIX, True))
        _llama_cpp_spaces(tokenizer, space_prefix=space_prefix)
    return tokenizer


def _llama_cpp_spaces(tokenizer: Tokenizer, *, space_prefix: bool) -> None:
    """Spaces as llama.cpp (and SentencePiece) treat them: every space is "▁", and
    each text run at the start or after a special token gets one more in front,
    even when it already starts with a space (Metaspace would skip that one)."""
    replace = normalizers.Replace(" ", "\u2581")
    steps = [normalizers.Prepend("\u2581"), replace] if space_prefix else [replace]
    tokenizer.normalizer = normalizers.Sequence(steps)
    tokenizer.pre_tokenizer = None
    tail = [decoders.ByteFallback(), decoders.Fuse()]
    strip = [decoders.Strip(" ", 1, 0)] if space_prefix else []
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), *tail, *strip])


def _merge_pair(merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep:
        raise ImportFailedError(f"malformed BPE merge {merge!r} in tokenizer.ggml.merges")
    return left, right


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _LLAMA3_PRE:
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False)
        no_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return pre_tokenizers.Sequence([split, no_regex])
    return byte_level


def _add_special_tokens(tokenizer: Tokenizer, tokens: list[str], token_types: Any) -> None:
    if token_types is None:
        return
    types = as_int_array(_TOKEN_TYPE, token_types).tolist()
    if len(types) != len(tokens):
        raise ImportFailedError(
            f"{_TOKEN_TYPE} has {len(types)} entries, but there are {len(tokens)} tokens"
        )
    control = [_added(tokens[i], special=True) for i, t in enumerate(types) if t == _CONTROL]
    user = [_added(tokens[i], special=False) for i, t in enumerate(types) if t == _USER_DEFINED]
    tokenizer.add_special_tokens(control)
    tokenizer.add_tokens(user)


def _added(content: str, *, special: bool) -> AddedToken:
    return AddedToken(content, special=special, normalized=False)


def _post_processor(
    names: dict[str, str], ids: dict[str, int | None], *, add_bos: bool, add_eos: bool
) -> processors.PostProcessor | None:
    # transformers' generic fast tokenizer adds BOS/EOS only through the post-processor.
    prefix = [names["bos"]] if add_bos and "bos" in names else []
    suffix = [names["eos"]] if add_eos and "eos" in names else []
    if not prefix and not suffix:
        return None
    single = " ".join([*prefix, "$A", *suffix])
    pair = " ".join([*prefix, "$A", *suffix, *prefix, "$B", *suffix])
    specials = [(names[r], ids[r]) for r in ("bos", "eos") if names.get(r) in prefix + suffix]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
