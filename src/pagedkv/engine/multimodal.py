"""Image inputs (vLLM's ``multi_modal_data``) and the encoder cache (vLLM's
``EncoderCacheManager``).

A prompt names its images with the model's image token, once per image (the processor then
expands it to the image's ``image_seq_length`` placeholder tokens) or already expanded:

    llm.generate({"prompt": "USER: <image>\\nWhat is this? ASSISTANT:",
                  "multi_modal_data": {"image": pil_image}})

Images may be PIL images, ``H×W×3`` uint8 arrays, encoded bytes (PNG, JPEG, ...), ``data:``
URLs or local file paths (nothing is downloaded). `MultiModalProcessor.process` turns them
into pixel values with the checkpoint's image processor, and the prompt into token ids with
each image's placeholder run: a `MultiModalFeature` (content hash, offset, length) the block
hashes include, so the same text with another image never hits the prefix cache, and the same
image does.

The runner encodes an image when a prefill chunk first needs one of its placeholder tokens
(chunked prefill may split the run) and keeps the output in the `EncoderCache`, by content
hash, while a running request needs it, within a budget of ``encoder_cache_size`` tokens: an
output that would push the cache past it is used for the step and not kept.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedkv.core.request import MultiModalFeature

# Largest encoded image accepted (bytes) and largest side (pixels): a bad input is refused
# before it costs memory or time.
MAX_IMAGE_BYTES = 32 << 20
MAX_IMAGE_SIDE = 16384


@dataclass(slots=True)
class ImageItem:
    """One processed image of a request: its placeholder run and its pixels ``[C, H, W]``."""

    feature: MultiModalFeature
    pixel_values: torch.Tensor


class ImageError(ValueError):
    """An image that cannot be used (corrupt, wrong type, too large): the request gets a 400."""


def load_image(value: Any) -> Any:
    """A PIL image (RGB) from any accepted form; ImageError says what is wrong."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        img = value
    elif hasattr(value, "__array__") and not isinstance(value, (bytes, str)):
        import numpy as np

        arr = np.asarray(value)
        if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] not in (1, 3, 4):
            raise ImageError(
                f"an image array must be H x W x 1/3/4 uint8, got {arr.dtype} {arr.shape}"
            )
        img = Image.fromarray(arr.squeeze(2) if arr.shape[2] == 1 else arr)
    else:
        data = _image_bytes(value)
        if len(data) > MAX_IMAGE_BYTES:
            raise ImageError(f"image of {len(data)} bytes is larger than {MAX_IMAGE_BYTES}")
        try:
            img = Image.open(io.BytesIO(data))
            img.load()
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
            raise ImageError(f"cannot decode the image: {e}") from None
    if max(img.size) > MAX_IMAGE_SIDE or min(img.size) < 1:
        raise ImageError(f"image of {img.size[0]}x{img.size[1]} pixels is out of bounds")
    return img.convert("RGB")


def _image_bytes(value: Any) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if not isinstance(value, (str, os.PathLike)):
        raise ImageError(f"unsupported image type {type(value).__name__}")
    text = str(value)
    if text.startswith("data:"):
        head, sep, payload = text.partition(",")
        if not sep or not head.endswith(";base64") or not head[5:].startswith("image/"):
            raise ImageError("a data URL image must be data:image/<type>;base64,<data>")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ImageError("the data URL's base64 payload does not decode") from None
    if text.startswith(("http://", "https://")):
        raise ImageError("image URLs are not fetched: pass a data: URL or a local file")
    path = Path(text.removeprefix("file://"))
    if not path.is_file():
        raise ImageError(f"no image file at {text!r}")
    if path.stat().st_size > MAX_IMAGE_BYTES:
        raise ImageError(
            f"image file of {path.stat().st_size} bytes is larger than {MAX_IMAGE_BYTES}"
        )
    return path.read_bytes()


class MultiModalProcessor:
    """Images → pixel values with the checkpoint's image processor
    (``preprocessor_config.json``; else CLIP's defaults at the tower's image size), and
    prompts → token ids with placeholder runs."""

    def __init__(
        self, model_dir: Path | None, image_token_id: int, image_seq_length: int, image_size: int
    ):
        try:
            import PIL  # noqa: F401  (load_image decodes with it)
            from transformers import CLIPImageProcessor
        except ImportError:
            raise ValueError(
                "image inputs need Pillow and transformers: pip install 'pagedkv[vision]'"
            ) from None

        self.image_token_id = image_token_id
        self.image_seq_length = image_seq_length
        cfg = model_dir / "preprocessor_config.json" if model_dir is not None else None
        if cfg is not None and cfg.exists():
            self.image_processor = CLIPImageProcessor.from_pretrained(model_dir)
        else:
            self.image_processor = CLIPImageProcessor(
                size={"shortest_edge": image_size},
                crop_size={"height": image_size, "width": image_size},
            )

    def pixel_values(self, image: Any) -> torch.Tensor:
        """``[3, H, W]`` float32 of one image (any accepted form)."""
        out = self.image_processor(images=[load_image(image)], return_tensors="pt")
        return out["pixel_values"][0].float()

    def process(self, token_ids: list[int], images: list[Any]) -> tuple[list[int], list[ImageItem]]:
        """Expand each image token (or accept an already expanded run) and pair the runs with
        ``images`` in order. ValueError if the counts differ or a run has another length."""
        runs: list[tuple[int, int]] = []
        i = 0
        while i < len(token_ids):
            if token_ids[i] != self.image_token_id:
                i += 1
                continue
            j = i
            while j < len(token_ids) and token_ids[j] == self.image_token_id:
                j += 1
            n = j - i
            if n % self.image_seq_length and n != 1:
                raise ValueError(
                    f"a run of {n} image tokens: give one per image, or {self.image_seq_length} "
                    "(its placeholder run)"
                )
            runs.extend(
                [(i, 1)]
                if n == 1
                else [(i + k, self.image_seq_length) for k in range(0, n, self.image_seq_length)]
            )
            i = j
        if len(runs) != len(images):
            raise ValueError(
                f"the prompt has {len(runs)} image placeholders but {len(images)} images"
            )
        out: list[int] = []
        items: list[ImageItem] = []
        prev = 0
        for (start, n), image in zip(runs, images):
            out.extend(token_ids[prev:start])
            pixels = self.pixel_values(image)
            digest = hashlib.sha256(pixels.numpy().tobytes()).hexdigest()
            items.append(
                ImageItem(MultiModalFeature(digest, len(out), self.image_seq_length), pixels)
            )
            out.extend([self.image_token_id] * self.image_seq_length)
            prev = start + n
        out.extend(token_ids[prev:])
        return out, items


def images_of(prompt: Any) -> list[Any]:
    """The images a prompt dict carries (``multi_modal_data={"image": one or a list}``)."""
    if not isinstance(prompt, dict) or prompt.get("multi_modal_data") is None:
        return []
    data = prompt["multi_modal_data"]
    if not isinstance(data, dict) or set(data) - {"image"}:
        raise ValueError("multi_modal_data takes only 'image' (one image or a list)")
    value = data.get("image")
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


@dataclass(slots=True)
class EncoderCacheStats:
    hits: int = 0
    misses: int = 0
    not_cached: int = 0  # outputs used for a step but not kept (over the budget)


@dataclass(slots=True)
class EncoderCache:
    """Encoder outputs by content hash (vLLM's ``EncoderCacheManager``, in the runner).

    Invariants: ``usage`` (tokens of the kept outputs) never exceeds ``budget``; an output
    some running request uses (``users``) is never dropped; one no request uses stays, LRU,
    until the budget needs its room."""

    budget: int
    entries: OrderedDict[str, torch.Tensor] = field(default_factory=OrderedDict)
    users: dict[str, set[str]] = field(default_factory=dict)
    stats: EncoderCacheStats = field(default_factory=EncoderCacheStats)
    # `offer` comes from the threads that prepare prompts (EPD fetches), the rest from the
    # engine thread.
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def usage(self) -> int:
        return sum(t.shape[0] for t in self.entries.values())

    def get(self, key: str, request_id: str, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The output for ``key`` (computed on a miss), now used by ``request_id``."""
        with self.lock:
            self.users.setdefault(key, set()).add(request_id)
            hit = self.entries.get(key)
            if hit is not None:
                self.entries.move_to_end(key)
                self.stats.hits += 1
                return hit
            self.stats.misses += 1
        out = compute()
        with self.lock:
            if key not in self.entries and self._make_room(out.shape[0]):
                self.entries[key] = out
            elif key not in self.entries:
                self.stats.not_cached += 1
        return out

    def offer(self, key: str, value: torch.Tensor) -> bool:
        """Keep an output computed elsewhere (EPD: read from an encoder instance) if the
        budget has room for it; whether it was kept."""
        with self.lock:
            if key in self.entries:
                return True
            if not self._make_room(value.shape[0]):
                return False
            self.entries[key] = value
            return True

    def _make_room(self, n: int) -> bool:
        if n > self.budget:
            return False
        free = self.budget - self.usage
        idle = [k for k in self.entries if not self.users.get(k)]
        if free + sum(self.entries[k].shape[0] for k in idle) < n:
            return False
        for k in idle:  # LRU first
            if free >= n:
                break
            free += self.entries.pop(k).shape[0]
        return True

    def release(self, request_id: str) -> None:
        """``request_id`` finished or was preempted: it uses nothing now."""
        with self.lock:
            self._release(request_id)

    def _release(self, request_id: str) -> None:
        for key in [k for k, u in self.users.items() if request_id in u]:
            self.users[key].discard(request_id)
            if not self.users[key]:
                del self.users[key]

    def check_invariants(self) -> None:
        assert self.usage <= self.budget, (self.usage, self.budget)


def encoder_cache_state(engine: Any) -> dict[str, Any] | None:
    """The encoder cache and EPD transfers as ``/metrics`` and the dashboard show them (None for
    a model without image inputs). Safe to call from any thread (plain reads of counters)."""
    if engine.mm_processor is None:
        return None
    cache = engine.runner.encoder_cache
    st = cache.stats
    queries = st.hits + st.misses
    with cache.lock:  # entries change on the engine thread and on prompt threads
        usage, entries = cache.usage, len(cache.entries)
    out: dict[str, Any] = dict(
        usage_tokens=usage,
        budget_tokens=cache.budget,
        entries=entries,
        queries=queries,
        hits=st.hits,
        hit_rate=st.hits / queries if queries else 0.0,
        not_cached=st.not_cached,
        ec_role=None,
    )
    ec = getattr(engine, "ec", None)
    if ec is not None:
        e = ec.stats
        out.update(
            ec_role=ec.config.ec_role,
            ec_published=e.published,
            ec_fetched=e.fetched,
            ec_fetch_failures=e.fetch_failures,
            ec_bytes_received=e.bytes_received,
            ec_fetch_seconds=e.fetch_seconds,
        )
    return out
