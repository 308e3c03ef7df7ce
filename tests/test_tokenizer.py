"""Tokenizer: ids, decoding, streaming detokenization and chat templates against transformers."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import jinja2
import pytest

from pagedkv.models.gguf_loader import read_gguf
from pagedkv.models.tokenizer import DetokenizeState, Tokenizer

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. 1234567890 3.14159",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "   leading spaces, trailing   \t\ttabs\t \n\n\n\nmany newlines\r\nCRLF",
    "unicode: café naïve résumé Ünïcödé — “quotes” … ½ ∑ ∫ √",
    "emoji 🤖🎉👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵",
    "CJK 日本語のテキスト 中文文本 한국어 텍스트",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>x<file_sep>y<|im_end|>",
    "it's they're we'll I'd you've don't SHOUTING'S",
    '{"json": [1, 2, {"k": null}], "url": "https://example.com/a?b=c&d=e"}',
    "",
    " ",
    "a",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Write a haiku about caches.\nMake it rhyme."},
    ],
    [
        {"role": "system", "content": "Be helpful."},
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "Unicode ✓ 日本"},
    ],
]


@pytest.fixture(scope="module")
def tok(gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(read_gguf(gguf_path).metadata)


@pytest.mark.parametrize("add_special", [True, False])
def test_ids_match_transformers(tok: Tokenizer, hf_tokenizer: Any, add_special: bool) -> None:
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens=add_special) == hf_tokenizer.encode(
            text, add_special_tokens=add_special
        ), text


def test_special_tokens_are_single_ids(tok: Tokenizer, hf_tokenizer: Any) -> None:
    for text in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        ids = tok.encode(text)
        assert len(ids) == 1 and ids[0] == hf_tokenizer.convert_tokens_to_ids(text)
    assert tok.eos_token_id == hf_tokenizer.eos_token_id
    assert tok.bos_token_id == hf_tokenizer.bos_token_id
    assert tok.eos_token_id in tok.stop_token_ids
    assert tok.token_to_id("<|im_end|>") in tok.stop_token_ids
    assert tok.vocab_size == len(hf_tokenizer)


@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers_and_round_trips(
    tok: Tokenizer, hf_tokenizer: Any, skip: bool
) -> None:
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(
            ids, skip_special_tokens=skip
        )
        if not skip:
            assert tok.decode(ids, skip_special_tokens=False) == text
    assert "<|im_start|>" not in tok.decode(
        tok.encode("<|im_start|>user\nhi"), skip_special_tokens=True
    )


def _stream(
    tok: Tokenizer, ids: list[int], chunks: list[int], skip: bool
) -> tuple[list[str], DetokenizeState]:
    state = DetokenizeState(skip_special_tokens=skip)
    deltas, i = [], 0
    for n in chunks:
        deltas.append(tok.decode_incremental(state, ids[i : i + n]))
        i += n
    deltas.append(tok.decode_incremental(state, ids[i:], final=True))
    return deltas, state


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_decode_equals_full_decode(tok: Tokenizer, skip: bool) -> None:
    rng = random.Random(0)
    for text in TEXTS:
        ids = tok.encode(text)
        for one_by_one in (True, False):
            chunks = [1] * len(ids) if one_by_one else []
            while not one_by_one and sum(chunks) < len(ids):
                chunks.append(rng.randint(1, 4))
            deltas, state = _stream(tok, ids, chunks, skip)
            assert "".join(deltas) == state.text == tok.decode(ids, skip_special_tokens=skip)
            # The texts contain no U+FFFD, so no delta may carry half a character.
            assert all("\ufffd" not in d for d in deltas)


def test_incremental_decode_holds_back_partial_characters(tok: Tokenizer) -> None:
    # Byte-level BPE splits rare characters into byte tokens: find one that spans several ids.
    text = next(t for t in ("𝔘", "👩‍👩‍👧‍👦", "🇯🇵", "ꙮ") if len(tok.encode(t)) > 1)
    ids = tok.encode(text)
    state = DetokenizeState()
    emitted = [tok.decode_incremental(state, [i]) for i in ids]
    assert "".join(emitted) == text
    assert emitted[0] == ""  # first byte(s) of the character alone are held back
    # Streaming is live: for plain ASCII every token's text comes out as soon as it arrives.
    state = DetokenizeState()
    words = tok.encode("one two three four")
    out = [tok.decode_incremental(state, [i]) for i in words]
    assert all(out) and "".join(out) == "one two three four"


def test_incremental_decode_flushes_invalid_utf8_on_final(tok: Tokenizer) -> None:
    # A lone UTF-8 lead byte (0xE2) never completes: only `final` releases it, as U+FFFD.
    lead = tok.token_to_id("â")  # byte 0xE2 in GPT-2's byte alphabet
    assert lead is not None
    ids = tok.encode("ok ") + [lead]
    state = DetokenizeState()
    first = tok.decode_incremental(state, ids)
    assert first == ""  # the tail is an incomplete character: hold everything in this window
    last = tok.decode_incremental(state, [], final=True)
    assert first + last == state.text == tok.decode(ids) == "ok \ufffd"


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tok: Tokenizer, hf_tokenizer: Any, add_generation_prompt: bool
) -> None:
    for conv in CONVERSATIONS:
        ours = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
        ref = hf_tokenizer.apply_chat_template(
            conv, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        assert ours == ref
    assert tok.apply_chat_template(CONVERSATIONS[0]).endswith("<|im_start|>assistant\n")


def test_chat_template_sandbox_and_raise_exception(tok: Tokenizer) -> None:
    evil = Tokenizer(
        tok.backend, bos_token_id=1, eos_token_id=2, chat_template="{{ ''.__class__.__mro__ }}"
    )
    with pytest.raises(jinja2.exceptions.SecurityError):
        evil.apply_chat_template(CONVERSATIONS[0])
    strict = Tokenizer(
        tok.backend,
        bos_token_id=1,
        eos_token_id=2,
        chat_template=(
            "{% if messages[0]['role'] != 'system' %}{{ raise_exception('need a system turn') }}{% endif %}ok"
        ),
    )
    with pytest.raises(jinja2.exceptions.TemplateError, match="need a system turn"):
        strict.apply_chat_template(CONVERSATIONS[0])
    assert strict.apply_chat_template(CONVERSATIONS[1]) == "ok"
    bare = Tokenizer(tok.backend, bos_token_id=1, eos_token_id=2, chat_template=None)
    with pytest.raises(ValueError):
        bare.apply_chat_template(CONVERSATIONS[0])


def test_hf_directory_tokenizer(tok: Tokenizer, hf_tokenizer: Any, tmp_path: Path) -> None:
    hf_tokenizer.save_pretrained(tmp_path)
    loaded = Tokenizer.from_hf_dir(tmp_path)
    for text in TEXTS:
        assert loaded.encode(text) == tok.encode(text)
    assert loaded.eos_token_id == tok.eos_token_id
    assert loaded.bos_token_id == tok.bos_token_id
    assert set(tok.stop_token_ids) <= set(loaded.stop_token_ids)
    for conv in CONVERSATIONS:
        assert loaded.apply_chat_template(conv) == tok.apply_chat_template(conv)


def test_gguf_add_bos_flag_adds_bos_only_with_special_tokens(gguf_path: Path) -> None:
    meta = dict(read_gguf(gguf_path).metadata)
    assert not meta["tokenizer.ggml.add_bos_token"]  # SmolLM2 adds nothing...
    meta["tokenizer.ggml.add_bos_token"] = True  # ...a Llama-style file asks for bos
    tok = Tokenizer.from_gguf_metadata(meta)
    plain = tok.encode("Hello there", add_special_tokens=False)
    assert tok.encode("Hello there") == [tok.bos_token_id, *plain]
    assert tok.decode(tok.encode("Hello there")) == "Hello there"
