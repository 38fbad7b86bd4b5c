"""Compile grammars with xgrammar for one model's tokenizer, with an LRU cache.

Compilation runs on the grammar pool (compile_pool.py), off the event loop;
compiled grammars are immutable and shared by every request that asks for the
same constraint.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from omlx.errors import InvalidRequestError
from omlx.grammar import torch_stub
from omlx.grammar.spec import GrammarSpec

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15 (./setup.sh does)"
_CACHE_ENTRIES = 128


# xgrammar's C++ errors start with "[12:17:08] /project/cpp/file.cc:83: ".
_LOG_PREFIX = re.compile(r"^\[\d{2}:\d{2}:\d{2}\] \S+:\d+: ", re.MULTILINE)


# xgrammar 0.2.8 writes a string with minLength/maxLength as characters "not a
# quote, backslash, CR or LF": a raw tab or other control character (invalid in
# JSON) gets through. The class below also leaves out U+0000-U+001F, and the
# surrogates, whose 3-byte encodings xgrammar accepts but no decoder does.
_LENGTH_CHARACTER = r"[^\"\\\r\n]"
_JSON_LENGTH_CHARACTER = r"[^\0-\x1f\"\\\uD800-\uDFFF]"


def json_safe_ebnf(ebnf: str) -> str:
    """xgrammar's EBNF for a JSON schema with no raw control characters in strings."""
    return ebnf.replace(_LENGTH_CHARACTER, _JSON_LENGTH_CHARACTER)


def clean_message(exc: Exception) -> str:
    return _LOG_PREFIX.sub("", str(exc)).strip()


def import_xgrammar() -> Any:
    """xgrammar, with the torch stub installed first; InvalidRequestError if missing."""
    torch_stub.install()
    try:
        import xgrammar
    except ImportError as exc:
        raise InvalidRequestError(
            f"structured output is unavailable: xgrammar cannot be imported ({exc}); "
            f"install it with: {INSTALL_HINT}"
        ) from exc
    return xgrammar


class GrammarCompiler:
    """xgrammar's compiler for one tokenizer plus our LRU of compiled grammars."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]):
        xgr = import_xgrammar()
        start = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        self._xgr = xgr
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(sorted(stop_token_ids))
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str, bool], Any] = OrderedDict()
        self.num_hits = 0
        self.num_compiled = 0
        log.info(
            "grammar tokenizer info ready in %.2f s (vocab %d, stop ids %s)",
            time.perf_counter() - start,
            vocab_size,
            sorted(stop_token_ids),
        )

    def cached(self, spec: GrammarSpec) -> Any | None:
        """The compiled grammar for ``spec`` if it is in the cache (cheap: no compile)."""
        with self._lock:
            compiled = self._cache.get(spec.cache_key)
            if compiled is not None:
                self._cache.move_to_end(spec.cache_key)
                self.num_hits += 1
            return compiled

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar for ``spec``; InvalidRequestError with the compiler's
        message when the schema, regex or grammar is invalid. Blocking: call it
        through the grammar pool (compile_pool.py)."""
        compiled = self.cached(spec)
        if compiled is not None:
            return compiled
        try:
            compiled = self._compile(spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise InvalidRequestError(
                f"invalid {spec.what}: {clean_message(exc)}", param=spec.param
            ) from exc
        with self._lock:
            self._cache[spec.cache_key] = compiled
            self.num_compiled += 1
            while len(self._cache) > _CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: GrammarSpec) -> Any:
        c = self._compiler
        if spec.kind == "json_schema":
            # Compact JSON: small models loop on free whitespace otherwise.
            grammar = self._xgr.Grammar.from_json_schema(
                spec.source, any_whitespace=False, strict_mode=spec.strict
            )
            return c.compile_grammar(json_safe_ebnf(str(grammar)))
        if spec.kind == "json_object":
            # OpenAI's json_object mode means an object, not any JSON value.
            return c.compile_json_schema(
                '{"type": "object"}', any_whitespace=False, strict_mode=False
            )
        if spec.kind == "regex":
            return c.compile_regex(spec.source)
        if spec.kind == "choice":
            return c.compile_grammar(spec.choice_ebnf())
        return c.compile_grammar(spec.source)

    def matcher(self, compiled: Any) -> Any:
        return self._xgr.GrammarMatcher(compiled)
