"""llguidance (vLLM's ``guidance`` backend): an Earley parser over a token trie, masks
computed lazily per step, no ahead-of-time compilation and no dependencies.

Measured on the default model's vocabulary (`benchmarks/bench_structured_outputs.py`): a
grammar is ready in 1-4 ms (every request: no cache), a mask costs a median 4-26 us, p99
47-232 us. JSON Schema, regex, choice, and Lark or GBNF grammars.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from pagedkv.engine.structured_output.backend_types import GrammarFactory


class GuidanceGrammar:
    """llguidance's matcher "stops" as soon as nothing but a stop token may follow; this
    grammar terminates (like xgrammar's) only once that stop token is accepted."""

    __slots__ = ("matcher", "stop_tokens", "terminated")

    def __init__(self, matcher: Any, stop_tokens: frozenset[int]) -> None:
        self.matcher = matcher
        self.stop_tokens = stop_tokens
        self.terminated = False

    def accept_token(self, token: int) -> bool:
        if self.terminated:
            return False
        if self.matcher.is_stopped():
            self.terminated = token in self.stop_tokens
            return self.terminated
        # A disallowed token puts the matcher in an error state it never leaves; check first.
        if self.matcher.validate_tokens([token]) != 1 or not self.matcher.consume_token(token):
            return False
        self.terminated = token in self.stop_tokens
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = bitmask.shape[1]
        self.matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * words * 4, words * 4)

    def is_terminated(self) -> bool:
        return self.terminated

    def fork(self) -> GuidanceGrammar:
        fork = GuidanceGrammar(self.matcher.deep_copy(), self.stop_tokens)
        fork.terminated = self.terminated
        return fork


class GuidanceBackend:
    """As `XgrammarBackend`: one per tokenizer (``tokenizers.Tokenizer``)."""

    name = "guidance"

    def __init__(self, backend_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import llguidance as llg

        self._llg = llg
        self.tokenizer = llg.LLTokenizer(
            backend_tokenizer.to_str(), n_vocab=vocab_size, eos_token=stop_token_ids
        )
        self.stop_tokens = frozenset(stop_token_ids)

    def compile(self, kind: str, spec: str, compact: bool) -> GrammarFactory:
        llg = self._llg
        m = llg.LLMatcher
        ws = {"whitespace_flexible": not compact}
        try:
            if kind == "json":
                grammar = m.grammar_from_json_schema(spec, defaults=ws)
            elif kind == "json_object":
                grammar = m.grammar_from_json_schema('{"type": "object"}', defaults=ws)
            elif kind == "regex":
                grammar = m.grammar_from_regex(spec)
            elif kind == "choice":
                grammar = m.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(s) for s in json.loads(spec))
                )
            elif kind == "grammar":
                grammar = llg.grammar_from("grammar", spec)  # Lark, or GBNF converted to Lark
            else:
                raise ValueError(f"unknown structured output kind {kind!r}")
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(str(e).strip()[:500]) from None
        is_error, messages = m.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise ValueError("; ".join(messages)[:500] or "invalid grammar")
        tokenizer, stops = self.tokenizer, self.stop_tokens
        return lambda: GuidanceGrammar(m(tokenizer, grammar, log_level=0), stops)
