"""Image inputs (issue 38, part 1): a tiny random-weight LLaVA built from a transformers
config, against transformers' own forward — greedy tokens and logprobs, through chunked
prefill that splits an image's placeholder run; the encoder cache; the image hash in the
block hashes; every accepted image form; bad images refused while the engine serves on."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pagedkv import LLM, SamplingParams
from pagedkv.engine.multimodal import EncoderCache, ImageError, load_image

IMAGE_TOKEN, SEQ, VOCAB = 127, 25, 128
GREEDY = SamplingParams(max_tokens=8, temperature=0, logprobs=2)


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Path]:
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    torch.manual_seed(0)
    text = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    vision = CLIPVisionConfig(
        image_size=30,
        patch_size=6,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
    )
    cfg = LlavaConfig(
        text_config=text, vision_config=vision, image_token_index=IMAGE_TOKEN, image_seq_length=SEQ
    )
    hf = LlavaForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # HF zero-inits biases and ones-inits norms: make them matter
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.3)
    path = tmp_path_factory.mktemp("llava")
    hf.save_pretrained(path)
    proc = CLIPImageProcessor(size={"shortest_edge": 30}, crop_size={"height": 30, "width": 30})
    proc.save_pretrained(path)
    return hf, proc, path


def image(seed: int, shape: tuple[int, int] = (40, 50)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*shape, 3), dtype=np.uint8)


def hf_run(
    llava: Any, ids: list[int], images: list[np.ndarray], n: int = 8
) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens and log-softmax rows, a full forward per token."""
    hf, proc, _ = llava
    pv = proc(images=images, return_tensors="pt")["pixel_values"]
    x, rows = list(ids), []
    with torch.inference_mode():
        for _ in range(n):
            logits = hf(input_ids=torch.tensor([x]), pixel_values=pv).logits[0, -1]
            rows.append(torch.log_softmax(logits.float(), -1))
            x.append(int(logits.argmax()))
    return x[len(ids) :], rows


def expand(prompt: list[int]) -> list[int]:
    out: list[int] = []
    for t in prompt:
        out.extend([IMAGE_TOKEN] * SEQ if t == IMAGE_TOKEN else [t])
    return out


def engine(llava: Any, **kw: Any) -> LLM:
    base = dict(model=str(llava[2]), max_model_len=192, num_kv_blocks=64, max_num_batched_tokens=16)
    return LLM(**{**base, **kw})


def run(llm: LLM, prompt: list[int], images: list[Any], sp: SamplingParams = GREEDY) -> Any:
    req = {"prompt_token_ids": prompt, "multi_modal_data": {"image": images}}
    return llm.generate([req], sp, use_tqdm=False)[0].outputs[0]


PROMPTS = [
    [1, 5, 9, IMAGE_TOKEN, 17, 33, 40],  # the run splits across 16-token chunks
    [2, IMAGE_TOKEN, 4, 6, IMAGE_TOKEN, 8],  # two images
]


@pytest.mark.parametrize("case", [0, 1])
def test_greedy_and_logprobs_equal_transformers_through_chunked_prefill(llava, case: int) -> None:
    prompt = PROMPTS[case]
    imgs = [image(10 + i) for i in range(prompt.count(IMAGE_TOKEN))]
    want, rows = hf_run(llava, expand(prompt), imgs)
    llm = engine(llava)
    out = run(llm, prompt, imgs)
    assert out.token_ids == want
    for tok, lp, ref in zip(out.token_ids, out.logprobs, rows):
        assert abs(lp[tok].logprob - float(ref[tok])) < 1e-4
    # The same request again: prefix hits and encoder cache hits, the same tokens.
    again = run(llm, prompt, imgs)
    assert again.token_ids == want
    assert llm.stats()["prefix_cache_hits"] > 0
    assert llm.llm_engine.runner.encoder_cache.stats.hits > 0


def test_another_image_never_hits_the_prefix_cache(llava) -> None:
    prompt = [3] * 20 + [IMAGE_TOKEN] + [5] * 12  # the image starts in the second block
    llm = engine(llava)
    run(llm, prompt, [image(1)])
    before = llm.stats()["prefix_cache_hits"]
    other = run(llm, prompt, [image(2)])
    hits = llm.stats()["prefix_cache_hits"] - before
    assert hits == 16  # only the block before the image
    assert other.token_ids == hf_run(llava, expand(prompt), [image(2)])[0]
    run(llm, prompt, [image(2)])
    assert llm.stats()["prefix_cache_hits"] - before - hits >= 48  # the same image hits


def test_every_image_form_gives_the_same_tokens(llava, tmp_path: Path) -> None:
    from PIL import Image

    arr = image(4)
    png = io.BytesIO()
    Image.fromarray(arr).save(png, format="PNG")
    path = tmp_path / "img.png"
    path.write_bytes(png.getvalue())
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    llm = engine(llava, encoder_cache_size=0)  # no cache: every form is encoded afresh
    prompt = PROMPTS[0]
    got = [
        run(llm, prompt, [form]).token_ids
        for form in (arr, Image.fromarray(arr), png.getvalue(), url, str(path), f"file://{path}")
    ]
    assert all(g == got[0] for g in got)
    assert got[0] == hf_run(llava, expand(prompt), [arr])[0]
    assert llm.llm_engine.runner.encoder_cache.usage == 0  # budget 0: nothing kept


@pytest.mark.parametrize(
    "bad, match",
    [
        (b"\x89PNG\r\n\x1a\nnot really", "cannot decode"),
        (12345, "unsupported image type"),
        ("data:text/plain;base64,aGk=", "data:image"),
        ("https://example.com/cat.png", "not fetched"),
        ("/no/such/file.png", "no image file"),
        (np.zeros((4, 4), dtype=np.float32), "uint8"),
    ],
)
def test_bad_images_are_refused_and_the_engine_serves_on(llava, bad: Any, match: str) -> None:
    llm = engine(llava)
    with pytest.raises(ImageError, match=match):
        run(llm, PROMPTS[0], [bad])
    assert (
        run(llm, PROMPTS[0], [image(10)]).token_ids
        == hf_run(llava, expand(PROMPTS[0]), [image(10)])[0]
    )


def test_too_large_and_mismatched_inputs_are_refused(llava) -> None:
    from PIL import Image

    big = io.BytesIO()
    Image.new("RGB", (20000, 1)).save(big, format="PNG")
    with pytest.raises(ImageError, match="out of bounds"):
        load_image(big.getvalue())
    llm = engine(llava)
    with pytest.raises(ValueError, match="2 image placeholders but 1 images"):
        run(llm, PROMPTS[1], [image(1)])
    with pytest.raises(ValueError, match="a run of 3 image tokens"):
        run(llm, [1, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN], [image(1)])
    with pytest.raises(ValueError, match="takes no images"):
        LLM(max_model_len=256).generate(
            [{"prompt_token_ids": [1, 2], "multi_modal_data": {"image": image(1)}}]
        )


def test_vmm_mode_runs_images_exactly(llava) -> None:
    llm = engine(llava, kv_cache_memory_mode="vmm", vmm_page_size=4096, max_num_seqs=4)
    assert (
        run(llm, PROMPTS[1], [image(3), image(4)]).token_ids
        == hf_run(llava, expand(PROMPTS[1]), [image(3), image(4)])[0]
    )


class EncoderCacheMachine(RuleBasedStateMachine):
    """Requests use images; the budget is never exceeded and a used output is never dropped."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = EncoderCache(budget=100)
        self.using: dict[str, set[str]] = {}  # request -> keys

    @rule(req=st.sampled_from("abcd"), key=st.sampled_from("wxyz"))
    def use(self, req: str, key: str) -> None:
        size = {"w": 10, "x": 30, "y": 60, "z": 120}[key]  # one size per content hash
        out = self.cache.get(key, req, lambda: torch.full((size, 2), float(ord(key))))
        assert out.shape[0] == size and float(out[0, 0]) == ord(key)
        if key in self.cache.entries:
            self.using.setdefault(req, set()).add(key)

    @rule(req=st.sampled_from("abcd"))
    def finish(self, req: str) -> None:
        self.cache.release(req)
        self.using.pop(req, None)

    @invariant()
    def within_budget(self) -> None:
        self.cache.check_invariants()
        for keys in self.using.values():  # kept outputs a live request uses stay kept
            assert keys <= set(self.cache.entries)


TestEncoderCache = EncoderCacheMachine.TestCase
TestEncoderCache.settings = settings(max_examples=50, stateful_step_count=30, deadline=None)


# ---- the OpenAI server: image_url content parts ------------------------------------------------

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


def _write_tokenizer(path: Path) -> None:
    """A word-level tokenizer over the tiny vocabulary: ``<image>`` is the image token."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "<s>", "</s>", "user", "assistant", ":"]
    words += [f"w{i}" for i in range(len(words), IMAGE_TOKEN)] + ["<image>"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    cfg = {"chat_template": CHAT_TEMPLATE, "bos_token": "<s>", "eos_token": "</s>"}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))


def test_chat_image_url_parts_over_http(llava, tmp_path: Path) -> None:
    import httpx
    from PIL import Image
    from server_utils import running_server

    from pagedkv.engine.config import EngineConfig

    path = llava[2]
    _write_tokenizer(path)
    arr = image(21)
    png = io.BytesIO()
    Image.fromarray(arr).save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    (tmp_path / "img.png").write_bytes(png.getvalue())
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "w7 w9"}]
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 6,
        "temperature": 0,
        "return_token_ids": True,
    }
    # The reference: the same template text, offline, through transformers.
    ids = [3, 5, IMAGE_TOKEN, 7, 9, 4, 5]  # "user : <image> w7 w9 assistant :"
    want = hf_run(llava, expand(ids), [arr], 6)[0]
    config = EngineConfig(model=str(path), max_model_len=192, num_kv_blocks=64)
    with running_server(config, allowed_local_media_path=str(tmp_path)) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["token_ids"] == want
            assert r.json()["usage"]["prompt_tokens"] == len(expand(ids))
            # A local file under the allowed directory: the same tokens.
            content[0]["image_url"]["url"] = f"file://{tmp_path / 'img.png'}"
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want
            for bad, status in [
                ("file:///etc/hostname", 400),  # outside the allowed directory
                ("https://example.com/x.png", 400),  # never fetched
                ("data:image/png;base64,AAAA", 400),  # corrupt
            ]:
                content[0]["image_url"]["url"] = bad
                r = http.post("/v1/chat/completions", json=body)
                assert r.status_code == status and r.json()["error"]["param"] == "messages", r.text
            content[0]["image_url"]["url"] = url
            assert (
                http.post("/v1/chat/completions", json=body).json()["choices"][0]["token_ids"]
                == want
            )  # still serving
