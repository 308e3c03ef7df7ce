"""Structured outputs in the engine: the params' checks, the bitmask kernel, both grammar
backends on the default model's real tokenizer (compile, cache, refusals, a matcher walked
token by token), and `LLM.generate` whose outputs always parse and are the masked argmax."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from pagedkv import LLM
from pagedkv.engine.sampler import _apply_bitmask
from pagedkv.engine.sampling_params import (
    SamplingParamError,
    SamplingParams,
)
from pagedkv.engine.sampling_params import StructuredOutputsParams as SO
from pagedkv.engine.structured_output import StructuredOutputManager
from pagedkv.engine.structured_output.manager import backend_installed
from pagedkv.models.tokenizer import Tokenizer
from pagedkv.ops import native

BACKENDS = [
    pytest.param(b, marks=pytest.mark.skipif(not backend_installed(b), reason=f"{b} not installed"))
    for b in ("xgrammar", "guidance")
]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
VOCAB = 49152


@pytest.fixture(scope="module")
def tokenizer(gguf_path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="module")
def manager(tokenizer) -> StructuredOutputManager:
    return StructuredOutputManager(tokenizer, VOCAB)


def allowed_tokens(grammar, vocab: int = VOCAB) -> torch.Tensor:
    bm = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
    grammar.fill_bitmask(bm, 0)
    bits = ((bm[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
    return bits.bool()


# ---- params -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, why",
    [
        ({}, "exactly one"),
        ({"json": PERSON, "regex": "a"}, "exactly one"),
        ({"json": "{nope"}, "not valid JSON"),
        ({"json": "[1, 2]"}, "JSON Schema"),
        ({"json": 3}, "JSON Schema"),
        ({"regex": ""}, "non-empty"),
        ({"choice": []}, "non-empty list"),
        ({"choice": ["a", ""]}, "non-empty list"),
        ({"choice": "a"}, "non-empty list"),
        ({"grammar": ""}, "non-empty"),
        ({"json_object": True, "backend": "outlines"}, "backend"),
    ],
)
def test_params_refuse_bad_shapes_naming_the_field(kwargs, why):
    with pytest.raises(SamplingParamError) as e:
        SO(**kwargs)
    assert e.value.param == "structured_outputs" and why in str(e.value)


def test_params_key_keeps_property_order():
    """xgrammar emits properties in schema order: two orders are two grammars."""
    a = SO(json={"type": "object", "properties": {"a": {}, "b": {}}})
    b = SO(json={"type": "object", "properties": {"b": {}, "a": {}}})
    assert a.key() != b.key()
    assert a.key() == SO(json=json.dumps(a.json, separators=(",", ":"))).key()
    assert SO(json=PERSON).key() != SO(json=PERSON, disable_any_whitespace=True).key()
    assert SO(json_object=True).key()[0] == "json_object"


def test_sampling_params_carry_structured_outputs():
    p = SamplingParams(structured_outputs=SO(regex="[0-9]+"))
    assert p.structured_outputs.regex == "[0-9]+"
    with pytest.raises(SamplingParamError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "x"})  # type: ignore[arg-type]


# ---- the bitmask kernel -------------------------------------------------------------------------


@pytest.mark.skipif(not native.available(), reason="native kernels not built")
@pytest.mark.parametrize("vocab, words", [(49152, 1536), (1000, 32), (1000, 30), (77, 3)])
def test_native_bitmask_equals_torch_unpack(vocab, words):
    gen = torch.Generator().manual_seed(vocab + words)
    rows = 5
    logits = torch.randn(rows, vocab, generator=gen)
    bm = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=gen)
    bm[1] = 0  # nothing allowed
    bm[2] = -1  # everything allowed
    bm[3, 1:] = 0  # only the first word's tokens
    bits = ((bm.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten(1).bool()
    allowed = torch.zeros(rows, vocab, dtype=torch.bool)
    n = min(vocab, bits.shape[1])
    allowed[:, :n] = bits[:, :n]  # tokens past the mask's words are never allowed
    want = logits.masked_fill(~allowed, float("-inf"))
    got = logits.clone()
    native.apply_token_bitmask(got, bm)
    assert torch.equal(got, want)
    # The sampler's torch fallback (a strided view: not the native kernel's layout) agrees.
    wide = torch.randn(rows, vocab * 2, generator=gen)
    wide[:, ::2] = logits
    view = wide[:, ::2]
    _apply_bitmask(view, bm)
    assert torch.equal(view, want)


# ---- backends on the real tokenizer -----------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_matcher_walks_a_valid_document(backend, manager, tokenizer):
    doc = json.dumps({"name": "Ada", "age": 36, "role": "admin"})
    grammar = manager.grammar_for(SO(json=PERSON, backend=backend))
    eos = tokenizer.eos_token_id
    for tok in tokenizer.encode(doc, add_special_tokens=False):
        allowed = allowed_tokens(grammar)
        assert allowed[tok], (backend, tokenizer.decode([tok]))
        assert not allowed[eos]  # not complete before the closing brace
        assert grammar.accept_token(tok)
    allowed = allowed_tokens(grammar)
    assert allowed[eos] and int(allowed.sum()) <= len(tokenizer.stop_token_ids)
    assert not grammar.is_terminated()
    assert grammar.accept_token(eos) and grammar.is_terminated()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_disallowed_token_is_refused_and_the_state_kept(backend, manager, tokenizer):
    grammar = manager.grammar_for(SO(choice=["yes", "no"], backend=backend))
    maybe = tokenizer.encode("maybe", add_special_tokens=False)[0]
    assert not allowed_tokens(grammar)[maybe]
    assert not grammar.accept_token(maybe)
    fork = grammar.fork()
    for tok in tokenizer.encode("yes", add_special_tokens=False):
        assert grammar.accept_token(tok)
    assert grammar.accept_token(tokenizer.eos_token_id) and grammar.is_terminated()
    assert not fork.is_terminated()  # a fork is independent of the matcher it came from
    for tok in tokenizer.encode("no", add_special_tokens=False):
        assert fork.accept_token(tok)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"json": {"type": "nonsense"}}, "nonsense"),
        ({"json": {"$ref": "#/$defs/missing"}}, "missing"),
        ({"regex": "a(b"}, ""),
        ({"grammar": "root ::= undefined_rule"}, "undefined_rule"),
    ],
)
def test_a_spec_that_does_not_compile_names_the_field(backend, manager, kwargs, message):
    with pytest.raises(SamplingParamError) as e:
        manager.compile(SO(**kwargs, backend=backend))
    assert e.value.param == "structured_outputs"
    assert "cannot compile" in str(e.value) and message in str(e.value)
    assert "/project/cpp" not in str(e.value)  # xgrammar's log prefix is stripped


def test_compiled_grammars_are_cached(tokenizer):
    m = StructuredOutputManager(tokenizer, VOCAB)
    p = SO(json=PERSON)
    assert not m.is_cached(p)
    m.compile(p)
    assert m.is_cached(p) and m.num_compiled == 1
    m.compile(SO(json=dict(PERSON)))  # an equal schema (another dict)
    assert m.num_compiled == 1 and m.num_cache_hits == 1
    small = StructuredOutputManager(tokenizer, VOCAB, cache_size=2)
    for c in ("a", "b", "c"):
        small.compile(SO(choice=[c]))
    assert small.stats()["cached_grammars"] == 2 and not small.is_cached(SO(choice=["a"]))


@pytest.mark.skipif(not backend_installed("guidance"), reason="llguidance not installed")
def test_auto_sends_to_llguidance_what_only_it_reads_or_enforces(tokenizer):
    m = StructuredOutputManager(tokenizer, VOCAB, backend="auto")
    m.compile(SO(grammar='start: "a" | "b"'))  # Lark
    m.compile(SO(regex=r"\p{Lu}[a-z]+"))  # a Unicode class: xgrammar refuses it
    assert {k[0] for k in m._cache} == {"guidance"} or not backend_installed("xgrammar")
    # A keyword xgrammar would accept without enforcing: llguidance refuses it clearly.
    with pytest.raises(SamplingParamError, match="not"):
        m.compile(SO(json={"not": {"type": "string"}}))
    if backend_installed("xgrammar"):
        m.compile(SO(json=PERSON))
        assert ("xgrammar", *SO(json=PERSON).key()) in m._cache


def test_no_tokenizer_means_no_structured_outputs():
    with pytest.raises(SamplingParamError, match="no tokenizer"):
        StructuredOutputManager(None, VOCAB).compile(SO(json_object=True))


# ---- generation ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_kv_blocks=256, block_size=16, max_model_len=1024)


def chat(llm: LLM, text: str) -> str:
    tok = llm.llm_engine.tokenizer
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def generate(llm: LLM, prompt: str, so: SO, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 96)
    return llm.generate([prompt], SamplingParams(structured_outputs=so, **kw))[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_generated_outputs_follow_their_grammar(llm, backend):
    person = chat(llm, "Describe a person as JSON with name, age and role.")
    out = generate(llm, person, SO(json=PERSON, backend=backend)).outputs[0]
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), PERSON)
    out = generate(llm, person, SO(json_object=True, backend=backend)).outputs[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict)
    out = generate(llm, chat(llm, "A US phone number?"), SO(regex=r"[0-9]{3}-[0-9]{4}")).outputs[0]
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", out.text) and out.finish_reason == "stop"
    out = generate(llm, chat(llm, "Is the sky blue?"), SO(choice=["yes", "no"], backend=backend))
    assert out.outputs[0].text in ("yes", "no")
    g = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    out = generate(llm, chat(llm, "Write a sum."), SO(grammar=g, backend=backend)).outputs[0]
    assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", out.text), out.text
    compact = generate(llm, person, SO(json=PERSON, disable_any_whitespace=True, backend=backend))
    assert "\n" not in compact.outputs[0].text
    jsonschema.validate(json.loads(compact.outputs[0].text), PERSON)


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_is_the_argmax_of_the_masked_raw_distribution(llm, backend):
    """Each greedy token is the likeliest token (raw logprobs, top 20) its grammar allows at
    that point, replayed on a fresh matcher of the same grammar."""
    so = SO(json=PERSON, backend=backend)
    out = generate(llm, chat(llm, "A person, as JSON."), so, logprobs=20).outputs[0]
    replay = llm.llm_engine.structured_output_manager.grammar_for(so)
    for tok, lps in zip(out.token_ids, out.logprobs):
        allowed = allowed_tokens(replay)
        assert allowed[tok]
        chosen = lps[tok].logprob
        better = [t for t, lp in lps.items() if lp.logprob > chosen]
        assert not any(allowed[t] for t in better), (tok, better)
        assert replay.accept_token(tok)
    assert replay.is_terminated()


def test_unconstrained_rows_are_untouched_in_a_mixed_batch(llm):
    prompts = [chat(llm, "Name three colors."), chat(llm, "A person, as JSON.")]
    plain = SamplingParams(temperature=0, max_tokens=24)
    alone = llm.generate([prompts[0]], plain)[0].outputs[0].token_ids
    structured = SamplingParams(temperature=0, max_tokens=64, structured_outputs=SO(json=PERSON))
    both = llm.generate(prompts, [plain, structured])
    assert both[0].outputs[0].token_ids == alone
    jsonschema.validate(json.loads(both[1].outputs[0].text), PERSON)


def test_n_samples_and_prefix_cache_each_follow_the_grammar(llm):
    prompt = chat(llm, "Invent a person and describe them as JSON. " * 8)  # a few full blocks
    params = SamplingParams(
        n=3, temperature=1.0, seed=7, max_tokens=96, structured_outputs=SO(json=PERSON)
    )
    first = llm.generate([prompt], params)[0]
    again = llm.generate([prompt], params)[0]
    assert again.num_cached_tokens > 0
    for out in first.outputs + again.outputs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)
    assert [o.text for o in first.outputs] == [o.text for o in again.outputs]  # seeded


def test_the_grammar_wins_over_min_tokens_and_ignore_eos(llm):
    out = generate(
        llm, chat(llm, "Yes or no?"), SO(choice=["yes", "no"]), min_tokens=10, ignore_eos=True
    ).outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


def test_a_bad_grammar_is_refused_and_the_engine_serves_on(llm):
    with pytest.raises(SamplingParamError, match="structured_outputs"):
        generate(llm, "hi", SO(regex="a(b"))
    assert not llm.llm_engine.has_unfinished_requests()
    out = generate(llm, chat(llm, "Yes or no?"), SO(choice=["yes", "no"])).outputs[0]
    assert out.text in ("yes", "no")
