"""Tokenizer: text <-> token ids, streaming detokenization and chat templates.

One ``Tokenizer`` wraps a ``tokenizers.Tokenizer`` built either from a GGUF file's metadata
(byte-level BPE, the way transformers converts it, so ids match the reference exactly) or from
an HF directory's ``tokenizer.json``. It also owns the model's special ids (bos/eos/pad and the
end-of-turn markers that stop generation) and renders the chat template with a sandboxed jinja2.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

# llama.cpp's token types (tokenizer.ggml.token_type).
_CONTROL, _USER_DEFINED = 3, 4

# Texts longer than this are encoded with the GIL released (see `Tokenizer.encode`).
_GIL_FREE_ENCODE_CHARS = 8192

# End-of-turn markers that stop generation besides eos (chat models end a reply with these).
_END_OF_TURN = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
)

# Split regexes for `tokenizer.ggml.pre` values that transformers' GGUF conversion maps to a
# custom split. Every other value (e.g. "smollm", "gpt2") keeps GPT-2's ByteLevel regex, which is
# what transformers produces and therefore what the reference tokenizes with.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet byte-level BPE vocabularies use."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def build_gguf_backend(meta: Mapping[str, Any]) -> BackendTokenizer:
    """A ``tokenizers.Tokenizer`` equal to the one transformers builds from this GGUF metadata.

    Only ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE: GPT-2, Llama 3, Qwen2, SmolLM...) is
    supported; sentencepiece-style GGUF vocabularies raise ``NotImplementedError``.
    """
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise NotImplementedError(
            f"GGUF tokenizer model {kind!r} is not supported (only 'gpt2' byte-level BPE)"
        )
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: Sequence[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    spell = bytes_to_unicode()
    alphabet = set(spell.values())
    # A token outside the byte alphabet is stored as plain text: respell it in bytes, as HF does.
    vocab = {
        (t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8"))): i
        for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    backend = BackendTokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    )
    split = _PRE_SPLITS.get(meta.get("tokenizer.ggml.pre", ""))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>...) must match whole; one spelled outside the byte alphabet is a
    # llama.cpp mislabel that transformers skips, and so do we.
    special = [t for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= alphabet]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    user = [t for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab]
    if user:
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    _add_bos_eos(backend, meta, tokens)
    return backend


def _add_bos_eos(backend: BackendTokenizer, meta: Mapping[str, Any], tokens: Sequence[str]) -> None:
    """Install a post-processor adding bos/eos when the file asks for them (``add_bos_token``),
    so ``encode(..., add_special_tokens=True)`` behaves as with an HF ``tokenizer.json``."""

    def wanted(flag: str, key: str) -> tuple[str, int] | None:
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if not meta.get(f"tokenizer.ggml.{flag}") or token_id is None:
            return None
        return tokens[token_id], int(token_id)

    bos, eos = wanted("add_bos_token", "bos_token_id"), wanted("add_eos_token", "eos_token_id")
    if bos is None and eos is None:
        return
    pre = [f"{bos[0]}:0"] if bos else []
    post = [f"{eos[0]}:0"] if eos else []
    backend.post_processor = processors.TemplateProcessing(
        single=[*pre, "$A:0", *post],
        pair=[*pre, "$A:0", *post, "$B:1", *post],
        special_tokens=[e for e in (bos, eos) if e is not None],
    )


@dataclass(slots=True)
class DetokenizeState:
    """Streaming detokenization state for one sequence (vLLM's prefix/read offsets).

    ``ids`` holds every token seen so far. Text for ``ids[:read_offset]`` has been emitted;
    ``ids[prefix_offset:read_offset]`` is the small window re-decoded as left context, so
    decoders that depend on neighbours (leading-space stripping) stay consistent.
    """

    skip_special_tokens: bool = True
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""  # everything emitted so far


class Tokenizer:
    """Text <-> ids for one model, plus its special ids and chat template.

    ``encode``/``decode`` match the transformers tokenizer for the same files. ``stop_token_ids``
    is eos plus end-of-turn markers present in the vocabulary (``<|im_end|>``, ``<|eot_id|>``...).
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        pad_token_id: int | None = None,
        chat_template: str | None = None,
        extra_stop_ids: Sequence[int] = (),
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id if pad_token_id is not None else eos_token_id
        self.chat_template = chat_template
        stops = [] if eos_token_id is None else [eos_token_id]
        stops += [i for i in extra_stop_ids if i not in stops]
        stops += [
            i for t in _END_OF_TURN if (i := backend.token_to_id(t)) is not None and i not in stops
        ]
        self.stop_token_ids: tuple[int, ...] = tuple(stops)

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF key/value metadata (see ``gguf_reader.read_gguf``)."""
        return cls(
            build_gguf_backend(meta),
            bos_token_id=_opt_int(meta.get("tokenizer.ggml.bos_token_id")),
            eos_token_id=_opt_int(meta.get("tokenizer.ggml.eos_token_id")),
            pad_token_id=_opt_int(meta.get("tokenizer.ggml.padding_token_id")),
            chat_template=meta.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        from pagedkv.models.gguf_reader import read_gguf

        return cls.from_gguf_metadata(read_gguf(path).metadata)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Build from an HF directory: ``tokenizer.json`` plus ``tokenizer_config.json`` (special
        tokens, chat template), ``chat_template.jinja`` and ``generation_config.json`` when present."""
        root = Path(path)
        backend = BackendTokenizer.from_file(str(root / "tokenizer.json"))
        cfg = _read_json(root / "tokenizer_config.json")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (root / "chat_template.jinja").exists():
            template = (root / "chat_template.jinja").read_text()

        def tok_id(name: str) -> int | None:
            tok = cfg.get(name)
            tok = tok.get("content") if isinstance(tok, dict) else tok
            return backend.token_to_id(tok) if tok else None

        gen = _read_json(root / "generation_config.json")
        model_cfg = _read_json(root / "config.json")
        eos = tok_id("eos_token")
        cfg_eos = gen.get("eos_token_id", model_cfg.get("eos_token_id"))
        extra = [cfg_eos] if isinstance(cfg_eos, int) else list(cfg_eos or [])
        if eos is None and extra:
            eos = extra[0]
        bos = tok_id("bos_token")
        if bos is None:
            bos = _opt_int(gen.get("bos_token_id", model_cfg.get("bos_token_id")))
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_id=eos,
            pad_token_id=tok_id("pad_token"),
            chat_template=template,
            extra_stop_ids=extra,
        )

    # ---- ids <-> text ---------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for ``text``; special-token text like ``<|im_start|>`` maps to its single id.

        ``add_special_tokens`` adds bos/eos only where the model's tokenizer asks for them
        (its post-processor; SmolLM2 asks for neither), matching transformers.
        Long text goes through ``encode_batch``, which releases the GIL while it works
        (``encode`` holds it throughout: seconds for megabytes, during which no other Python
        thread runs, the engine loop included); the ids are the same.
        """
        if len(text) > _GIL_FREE_ENCODE_CHARS:
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_incremental(
        self, state: DetokenizeState, new_ids: Sequence[int], *, final: bool = False
    ) -> str:
        """Append ``new_ids`` to ``state`` and return the newly completed text.

        Never returns a partial UTF-8 character: while the decoded tail ends in U+FFFD (bytes of a
        character still arriving) the text is held back, unless ``final`` flushes it. Once called
        with ``final=True``, ``state.text == decode(state.ids)``.
        """
        state.ids.extend(new_ids)
        skip = state.skip_special_tokens
        prefix_text = self.decode(state.ids[state.prefix_offset : state.read_offset], skip)
        full_text = self.decode(state.ids[state.prefix_offset :], skip)
        if len(full_text) <= len(prefix_text) or (full_text.endswith("\ufffd") and not final):
            return ""
        delta = full_text[len(prefix_text) :]
        state.prefix_offset, state.read_offset = state.read_offset, len(state.ids)
        state.text += delta
        return delta

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    # ---- chat -----------------------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render the model's chat template (or ``chat_template``) to prompt text, as
        transformers does.

        With ``continue_final_message`` the text ends right after the last message's content
        (no end-of-turn marker), so the model continues that message. ``kwargs`` (``tools``,
        ``documents``, template-specific flags) are passed to the template. Raises
        ``ValueError`` when there is no template, or the last message's content is not found.
        """
        source = chat_template or self.chat_template
        if not source:
            raise ValueError("this model has no chat template")
        specials = {
            "bos_token": self._token_text(self.bos_token_id),
            "eos_token": self._token_text(self.eos_token_id),
            "pad_token": self._token_text(self.pad_token_id),
        }
        text = _compile_template(source).render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            **specials,
            **kwargs,
        )
        if continue_final_message:
            text = _cut_after_final_message(text, str(messages[-1].get("content") or ""))
        return text

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.backend.id_to_token(token_id) or "")


def _cut_after_final_message(text: str, final: str) -> str:
    """``text`` up to the end of its last occurrence of ``final`` (transformers'
    ``continue_final_message``: the template's whitespace handling kept when it matches)."""
    try:
        at = text.rindex(final.strip())
    except ValueError:
        raise ValueError(
            "continue_final_message: the last message's content is not in the rendered chat"
        ) from None
    keep = final.lstrip()
    end = at + (len(keep) if text[at : at + len(keep)] == keep else len(final.strip()))
    return text[:end]


@lru_cache(maxsize=8)
def _compile_template(source: str) -> Any:
    """A chat template compiled in a sandbox with transformers' environment and globals."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        # jinja's built-in tojson HTML-escapes; templates expect plain JSON.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _opt_int(x: Any) -> int | None:
    return None if x is None else int(x)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}
