"""A request body's prompt token ids, exactly as the replica will tokenize it.

The replicas' own code paths are reused: the body is validated with the server's pydantic
models (`pagedkv.entrypoints.openai.protocol`); chat messages become the server's ``conversation()``,
rendered with the model's chat template and encoded without special tokens
(serving_chat.py); a completion's text prompt is encoded with special tokens, token-id prompts
are taken as they are (serving_engine.tokenize). A body the server would reject gives None: the
router then routes on load and the replica answers the 400 itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class PromptInfo:
    token_ids: list[int]
    cache_salt: str | None


class PromptTokenizer:
    """Wraps the model's `pagedkv.models.tokenizer.Tokenizer` (the replica's ``model_path``,
    or ``--tokenizer``)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer

    @classmethod
    def from_path(cls, path: str) -> PromptTokenizer:
        """A tokenizer from an HF directory (``tokenizer.json``) or a ``.gguf`` file."""
        from pathlib import Path

        from pagedkv.models.tokenizer import Tokenizer

        p = Path(path)
        if p.suffix.lower() == ".gguf":
            return cls(Tokenizer.from_gguf(p))
        if not (p / "tokenizer.json").exists():
            raise FileNotFoundError(f"{path}: no tokenizer.json (give the router --tokenizer PATH)")
        return cls(Tokenizer.from_hf_dir(p))

    def prompt(self, path: str, body: dict[str, Any]) -> PromptInfo | None:
        """The first prompt of a ``/v1/completions`` or ``/v1/chat/completions`` body (a list of
        prompts is routed by its first: they all go to one replica), or None."""
        from pydantic import ValidationError

        from pagedkv.entrypoints.openai import protocol as P

        try:
            if path.endswith("/chat/completions"):
                chat = P.ChatCompletionRequest.model_validate(body)
                text = self.tok.apply_chat_template(
                    chat.conversation(), add_generation_prompt=chat.add_generation_prompt
                )
                return PromptInfo(self.tok.encode(text, add_special_tokens=False), chat.cache_salt)
            comp = P.CompletionRequest.model_validate(body)
            first = comp.prompts()[0]
            ids = self.tok.encode(first) if isinstance(first, str) else list(first)
            return PromptInfo(ids, comp.cache_salt)
        except (ValidationError, P.RequestError, ValueError, IndexError, TypeError):
            return None
