"""xgrammar (vLLM's default structured-output backend): grammars compiled ahead into a
token-mask cache, so a step's mask costs a few microseconds per request.

Measured on the default model's 49,152-token vocabulary (`benchmarks/bench_structured_outputs.py`,
library section): median 4-6 us per mask (26 us for any JSON object), p99 <= 63 us; compile
0.3-13 ms, a repeat 0.03 ms (the compiler's own cache). JSON Schema, regex, choice (as an EBNF
alternation) and EBNF/GBNF grammars.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from pagedkv.engine.structured_output.backend_types import GrammarFactory


class XgrammarGrammar:
    __slots__ = ("matcher",)

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept_token(self, token: int) -> bool:
        return bool(self.matcher.accept_token(token))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def fork(self) -> XgrammarGrammar:
        return XgrammarGrammar(self.matcher.fork())


class XgrammarBackend:
    """One compiler per tokenizer. ``backend_tokenizer`` is a ``tokenizers.Tokenizer``;
    ``vocab_size`` the model's logits width (may exceed the tokenizer's: padding rows are
    never allowed); ``stop_token_ids`` end a complete grammar (the engine's EOS)."""

    name = "xgrammar"

    def __init__(self, backend_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        self._xgr = xgr
        # xgrammar's own detection of the vocabulary type (byte-level, byte-fallback, raw)
        # from the tokenizer's JSON: its public path takes a transformers fast tokenizer.
        hf = PreTrainedTokenizerFast(tokenizer_object=backend_tokenizer)
        info = xgr.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True)

    def compile(self, kind: str, spec: str, compact: bool) -> GrammarFactory:
        c = self.compiler
        try:
            if kind == "json":
                compiled = c.compile_json_schema(spec, any_whitespace=not compact)
            elif kind == "json_object":
                compiled = c.compile_json_schema('{"type": "object"}', any_whitespace=not compact)
            elif kind == "regex":
                compiled = c.compile_regex(spec)
            elif kind == "choice":
                compiled = c.compile_grammar(
                    "root ::= " + " | ".join(_ebnf_string(s) for s in json.loads(spec))
                )
            elif kind == "grammar":
                compiled = c.compile_grammar(spec)
            else:
                raise ValueError(f"unknown structured output kind {kind!r}")
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(_first_line(e)) from None
        matcher = self._xgr.GrammarMatcher
        return lambda: XgrammarGrammar(matcher(compiled))


def _ebnf_string(s: str) -> str:
    """``s`` as an EBNF string literal (JSON's escapes are EBNF's)."""
    return json.dumps(s, ensure_ascii=False)


# xgrammar's messages start with its log prefix: "[07:21:17] /project/cpp/x.cc:94: ".
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def _first_line(e: BaseException) -> str:
    text = _LOG_PREFIX.sub("", str(e).strip()) or type(e).__name__
    return text.splitlines()[0][:500]


def xgrammar_ignores(schema: Any) -> bool:
    """Whether ``schema`` uses a keyword xgrammar accepts but does not enforce (measured on
    0.2.9: ``not``, and ``pattern``s with look-around), so its outputs might not validate.
    `StructuredOutputManager`'s "auto" sends such schemas to llguidance, which enforces them
    or refuses them with a clear error."""
    if isinstance(schema, dict):
        if "not" in schema:
            return True
        pattern = schema.get("pattern")
        if isinstance(pattern, str) and re.search(r"\(\?<?[=!]", pattern):
            return True
        return any(xgrammar_ignores(v) for v in schema.values())
    if isinstance(schema, list):
        return any(xgrammar_ignores(v) for v in schema)
    return False
