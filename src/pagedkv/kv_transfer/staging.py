"""Compressed PD transfers (seed §8.2; CacheGen): the `NixlConnector`'s ``transfer_codec``.

KV is compressed only while it travels; what attention computes in either engine's device
cache is unchanged (a lossy codec changes only what the consumer receives). The stages:

1. **Producer, encode.** When a request with ``do_remote_decode`` finishes, a worker thread
   gathers each held block (every registered region: all layers, all TP ranks) and encodes it
   with an `offload.codec` codec into a *frame* in the producer's `StagingArea`. A frame is
   whole slots of `SLOT_BYTES`, with a CRC-32 of its encoded bytes.
2. **Consumer, layout.** The consumer asks the producer's side channel (``staged:<request
   id>``, answered on the listener thread) where the frames are: ``pending`` while encoding,
   ``ready`` with the frames, or ``raw`` when they did not fit the staging area (then it reads
   the blocks themselves, as without a codec).
3. **Consumer, read.** It reads the frames' slots into its own staging area with the same
   transfer backend (NIXL or TCP): a second agent per engine over the staging memory, so the
   wire carries encoded bytes.
4. **Consumer, decode.** A worker thread checks each frame's CRC, decodes it and scatters it
   into the request's blocks; then the producer is told to free (``done:``).

Encoding and decoding run on worker threads, never on a step's critical path. Both engines must
configure the same codec (the handshake compares ``transfer_codec``, as it does the KV dtype).
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np

from pagedkv.offload.codec import CodecError, KVCodec
from pagedkv.transfer.base import MemoryRegion
from pagedkv.transfer.tcp import gather, scatter

SLOT_BYTES = 4096  # staging granularity: a frame is whole slots, moved as one run of slot ids
STAGED_PREFIX = b"staged:"  # side-channel query: STAGED_PREFIX + producer request id
DEFAULT_STAGING_MIB = 256


@dataclass(frozen=True, slots=True)
class Frame:
    """One block's encoded bytes: ``num_slots`` slots from ``slot``, ``nbytes`` used, and the
    CRC-32 of those bytes."""

    slot: int
    num_slots: int
    nbytes: int
    crc: int


class StagingArea:
    """``num_slots`` slots of `SLOT_BYTES` in one page-aligned buffer, registered with a
    transfer backend as one `MemoryRegion`. Allocation is first fit over free extents; every
    method is thread-safe (encoders, decoders and the engine thread share it)."""

    def __init__(self, nbytes: int) -> None:
        self.num_slots = max(1, nbytes // SLOT_BYTES)
        self._buf = np.zeros(self.num_slots * SLOT_BYTES + 4096, dtype=np.uint8)
        base = self._buf.ctypes.data
        self._off = (-base) % 4096
        self.region = MemoryRegion(base + self._off, self.num_slots, SLOT_BYTES, SLOT_BYTES)
        self._free: list[tuple[int, int]] = [(0, self.num_slots)]  # (start, length), sorted
        self._lock = threading.Lock()

    @property
    def free_slots(self) -> int:
        with self._lock:
            return sum(n for _, n in self._free)

    def alloc(self, num_slots: int) -> int | None:
        """The first slot of ``num_slots`` free consecutive slots, or None."""
        with self._lock:
            for i, (start, n) in enumerate(self._free):
                if n >= num_slots:
                    if n == num_slots:
                        del self._free[i]
                    else:
                        self._free[i] = (start + num_slots, n - num_slots)
                    return start
        return None

    def free(self, start: int, num_slots: int) -> None:
        """Return slots to the pool, merging neighbours (an overlap is a bug: AssertionError)."""
        with self._lock:
            extents = sorted([*self._free, (start, num_slots)])
            merged: list[tuple[int, int]] = []
            for s, n in extents:
                if merged and merged[-1][0] + merged[-1][1] >= s:
                    ps, pn = merged[-1]
                    assert ps + pn == s, f"slots {s}..{s + n} freed twice"
                    merged[-1] = (ps, pn + n)
                else:
                    merged.append((s, n))
            self._free = merged

    def view(self, slot: int, nbytes: int) -> memoryview:
        start = self._off + slot * SLOT_BYTES
        return memoryview(self._buf)[start : start + nbytes]


def slots_of(frames: Sequence[Frame]) -> list[int]:
    """Every slot id of ``frames``, in order (the transfer's block ids)."""
    return [s for f in frames for s in range(f.slot, f.slot + f.num_slots)]


def free_frames(area: StagingArea, frames: Sequence[Frame]) -> None:
    for f in frames:
        area.free(f.slot, f.num_slots)


def encode_blocks(
    area: StagingArea, codec: KVCodec, regions: Sequence[MemoryRegion], block_ids: Sequence[int]
) -> list[Frame] | None:
    """Encode each block (its bytes in every region, concatenated) into a frame of ``area``.
    None (nothing kept) when the frames do not fit: the caller serves the blocks raw."""
    frames: list[Frame] = []
    for b in block_ids:
        raw = b"".join(gather(r, [b]) for r in regions)
        enc = memoryview(codec.encode(memoryview(raw))).cast("B")
        n = -(-enc.nbytes // SLOT_BYTES)
        slot = area.alloc(n)
        if slot is None:
            free_frames(area, frames)
            return None
        area.view(slot, enc.nbytes)[:] = enc
        frames.append(Frame(slot, n, enc.nbytes, zlib.crc32(enc)))
    return frames


def decode_blocks(
    area: StagingArea,
    codec: KVCodec,
    regions: Sequence[MemoryRegion],
    first_slot: int,
    frames: Sequence[Frame],
    block_ids: Sequence[int],
) -> None:
    """Decode frames laid out back to back from ``first_slot`` of ``area`` (as the consumer
    read them) into ``block_ids``. CodecError on a CRC mismatch or a frame that does not
    decode: nothing is trusted then (the caller reports the blocks invalid)."""
    block_bytes = sum(r.block_len for r in regions)
    out = bytearray(block_bytes)
    slot = first_slot
    for f, b in zip(frames, block_ids, strict=True):
        enc = area.view(slot, f.nbytes)
        slot += f.num_slots
        if zlib.crc32(enc) != f.crc:
            raise CodecError(f"frame of block {b} fails its CRC")
        codec.decode(enc, memoryview(out))
        off = 0
        for r in regions:
            scatter(r, [b], memoryview(out)[off : off + r.block_len])
            off += r.block_len


# ---- the side-channel layout query -------------------------------------------------------------


def layout_reply(state: str, frames: Sequence[Frame] = ()) -> bytes:
    """``state``: "ready" (with ``frames``), "pending", "raw" or "unknown"."""
    return msgspec.msgpack.encode(
        {"state": state, "frames": [[f.slot, f.num_slots, f.nbytes, f.crc] for f in frames]}
    )


def parse_layout(reply: bytes) -> tuple[str, list[Frame]]:
    try:
        d = msgspec.msgpack.decode(reply)
        return str(d["state"]), [Frame(*map(int, f)) for f in d["frames"]]
    except Exception as e:  # a malformed reply is the producer's fault: the read fails
        raise CodecError(f"malformed staging layout: {e}") from None
