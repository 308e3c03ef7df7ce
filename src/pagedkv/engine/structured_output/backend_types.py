"""What a structured-output backend provides (vLLM's ``backend_types.py``).

A backend (`backend_xgrammar.py`, `backend_guidance.py`) compiles a `StructuredOutputsParams`
for one tokenizer into a `GrammarFactory`; each request gets its own `StructuredOutputGrammar`
(a matcher: the grammar's state after the tokens accepted so far). The bitmask layout is shared
by both libraries: int32 words, bit ``b`` of word ``w`` set when token ``32 w + b`` is allowed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class StructuredOutputGrammar(Protocol):
    """One request's matcher. Not thread-safe: the engine thread alone uses it."""

    def accept_token(self, token: int) -> bool:
        """Advance by ``token``; False (state unchanged) when the grammar does not allow it."""
        ...

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (only stop tokens once complete)."""
        ...

    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token accepted: nothing may follow."""
        ...

    def fork(self) -> StructuredOutputGrammar:
        """An independent matcher in the same state (a forked ``n > 1`` sample)."""
        ...


# A compiled grammar: called once per request for a fresh matcher.
GrammarFactory = Callable[[], StructuredOutputGrammar]


class StructuredOutputBackend(Protocol):
    name: str

    def compile(self, kind: str, spec: str, compact: bool) -> GrammarFactory:
        """Compile ``(kind, spec)`` (`StructuredOutputsParams.key`: kind "json", "json_object",
        "regex", "choice" (a JSON list) or "grammar"); ``compact``: JSON without free
        whitespace. ValueError naming the problem for a spec it cannot compile."""
        ...
