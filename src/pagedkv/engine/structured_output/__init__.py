"""Structured outputs (vLLM's ``v1/structured_output``): grammars compiled per request
(`StructuredOutputManager`), one matcher per request (`StructuredOutputGrammar`), and the
token bitmask the sampler applies. Backends: `backend_xgrammar.py`, `backend_guidance.py`."""

from pagedkv.engine.structured_output.backend_types import (
    GrammarFactory,
    StructuredOutputBackend,
    StructuredOutputGrammar,
)
from pagedkv.engine.structured_output.manager import (
    BACKENDS,
    StructuredOutputManager,
    backend_installed,
)

__all__ = [
    "BACKENDS",
    "GrammarFactory",
    "StructuredOutputBackend",
    "StructuredOutputGrammar",
    "StructuredOutputManager",
    "backend_installed",
]
