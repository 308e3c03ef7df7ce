"""KVTransferBackend implementations (NIXL over UCX, pure-Python TCP) on real pagedkv KV memory.

Same tests for both backends: two agents in one process, and two agents in two processes
(spawn), moving scattered blocks of an ``LBNHC`` CPU cache (one region per layer) byte-exactly.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import sys
import time
import uuid
from typing import Any

import pytest
import torch

from pagedkv.ops.kv_cache import allocate_kv_cache
from pagedkv.transfer import (
    KVTransferBackend,
    MemoryRegion,
    get_transfer_backend,
    nixl_import_error,
)

NUM_LAYERS, NUM_BLOCKS = 2, 16
NIXL_REASON = nixl_import_error()
BACKENDS = [
    pytest.param(
        "nixl", marks=pytest.mark.skipif(NIXL_REASON is not None, reason=f"nixl: {NIXL_REASON}")
    ),
    "tcp",
    "tcp-socket",
]  # tcp: same-host process_vm_* fast path; tcp-socket: ZMQ only
TIMEOUT_S = 3.0  # backend timeout for the dead-peer test
WAIT_S = 30.0  # test-side bound on every wait (spawned children import torch)


def make_kv(seed: float) -> tuple[torch.Tensor, list[MemoryRegion]]:
    """A pagedkv KV buffer filled with a pattern unique to ``seed``, and one region per layer."""
    buf, _ = allocate_kv_cache(
        "LBNHC",
        num_layers=NUM_LAYERS,
        num_blocks=NUM_BLOCKS,
        block_size=16,
        num_kv_heads=2,
        head_size=8,
        dtype=torch.float32,
    )
    buf.view(-1).copy_(torch.arange(buf.numel(), dtype=torch.float32) + seed * 1e6)
    block_bytes = buf[0, 0].numel() * buf.element_size()
    regions = [
        MemoryRegion(
            buf.data_ptr() + layer * NUM_BLOCKS * block_bytes, NUM_BLOCKS, block_bytes, block_bytes
        )
        for layer in range(NUM_LAYERS)
    ]
    return buf, regions


def blocks(buf: torch.Tensor, ids: list[int]) -> list[bytes]:
    """Every region's bytes of ``ids``, layer-major."""
    return [buf[layer, b].numpy().tobytes() for layer in range(NUM_LAYERS) for b in ids]


def untouched(ids: list[int]) -> list[int]:
    return [b for b in range(NUM_BLOCKS) if b not in ids]


def backend(kind: str, name: str, **kw: Any) -> KVTransferBackend:
    if kind == "tcp-socket":
        return get_transfer_backend(name, "tcp", fast_path=False, **kw)
    return get_transfer_backend(name, kind, **kw)


def new_backend(kind: str, role: str, **kw: Any) -> KVTransferBackend:
    return backend(kind, f"{role}-{uuid.uuid4().hex[:8]}", **kw)


def wait_done(be: KVTransferBackend, handle: int, timeout: float = WAIT_S) -> str:
    deadline = time.monotonic() + timeout
    while (state := be.check_xfer_state(handle)) == "PROC":
        assert time.monotonic() < deadline, "transfer still PROC past the test bound"
        time.sleep(0.002)
    return state


def wait_notif(
    be: KVTransferBackend,
    timeout: float = WAIT_S,
    initiator: tuple[KVTransferBackend, int] | None = None,
) -> dict[str, list[bytes]]:
    """Poll ``be`` for notifs; meanwhile poll the ``(backend, handle)`` that will send one, as an
    engine does every step (NIXL emits a transfer's notif from its completion path)."""
    deadline = time.monotonic() + timeout
    while not (got := be.get_new_notifs()):
        assert time.monotonic() < deadline, "no notif within the test bound"
        if initiator is not None:
            initiator[0].check_xfer_state(initiator[1])
        time.sleep(0.002)
    return got


@pytest.fixture
def pair(request: pytest.FixtureRequest):
    """Two connected agents in this process, each with its own KV buffer."""
    kind = request.param
    a, b = new_backend(kind, "a"), new_backend(kind, "b")
    buf_a, reg_a = make_kv(1)
    buf_b, reg_b = make_kv(2)
    try:
        a.register_kv_memory(reg_a)
        b.register_kv_memory(reg_b)
        peer_b = a.add_remote_agent(b.get_agent_metadata())
        peer_a = b.add_remote_agent(a.get_agent_metadata())
        yield a, b, buf_a, buf_b, peer_a, peer_b
    finally:
        a.shutdown()
        b.shutdown()


@pytest.mark.parametrize("pair", BACKENDS, indirect=True)
def test_read_scattered_blocks_in_process(pair, request: pytest.FixtureRequest) -> None:
    a, b, buf_a, buf_b, peer_a, peer_b = pair
    assert peer_b == b.name and peer_a == a.name
    if a.kind == "tcp":  # one process: process_vm_* on our own pid is always allowed
        assert a.uses_fast_path(peer_b) == (request.node.callspec.params["pair"] == "tcp")
    local, remote = [0, 5, 12, 13], [3, 7, 1, 15]
    before_a = buf_a.clone()
    h = a.read_blocks(peer_b, local, remote, notif=b"read-1")
    assert wait_done(a, h) == "DONE"
    a.release_xfer(h)
    assert blocks(buf_a, local) == blocks(buf_b, remote)
    assert blocks(buf_a, untouched(local)) == blocks(before_a, untouched(local))
    assert wait_notif(b) == {a.name: [b"read-1"]}


@pytest.mark.parametrize("pair", BACKENDS, indirect=True)
def test_write_notif_after_data_in_process(pair) -> None:
    a, b, buf_a, buf_b, _, peer_b = pair
    local, remote = [2, 9, 10], [4, 15, 0]
    before_b = buf_b.clone()
    h = a.write_blocks(peer_b, local, remote, notif=b"write-1")
    # The receiver looks at its memory as soon as the notif shows up, not after the sender's DONE.
    assert wait_notif(b, initiator=(a, h)) == {a.name: [b"write-1"]}
    assert blocks(buf_b, remote) == blocks(buf_a, local)
    assert blocks(buf_b, untouched(remote)) == blocks(before_b, untouched(remote))
    assert wait_done(a, h) == "DONE"
    a.release_xfer(h)


@pytest.mark.parametrize("pair", BACKENDS, indirect=True)
def test_empty_transfer_still_notifies(pair) -> None:
    a, b, buf_a, buf_b, _, peer_b = pair
    before_a, before_b = buf_a.clone(), buf_b.clone()
    for op in (a.read_blocks, a.write_blocks):
        h = op(peer_b, [], [], notif=b"full-hit")
        assert wait_done(a, h) == "DONE"
        assert wait_notif(b) == {a.name: [b"full-hit"]}
        a.release_xfer(h)
    assert torch.equal(buf_a, before_a) and torch.equal(buf_b, before_b)


@pytest.mark.parametrize("pair", BACKENDS, indirect=True)
def test_out_of_range_block_ends_err(pair) -> None:
    a, _, _, _, _, peer_b = pair
    h = a.read_blocks(peer_b, [0], [NUM_BLOCKS], notif=b"x")
    assert wait_done(a, h) == "ERR"
    with pytest.raises(ValueError, match="unknown peer"):
        a.read_blocks("nobody", [0], [0])


@pytest.mark.parametrize("pair", BACKENDS, indirect=True)
def test_send_notif_control_message(pair) -> None:
    a, b, _, _, peer_a, peer_b = pair
    a.send_notif(peer_b, b"HB:r1,r2")
    assert wait_notif(b) == {a.name: [b"HB:r1,r2"]}
    b.send_notif(peer_a, b"back")
    assert wait_notif(a) == {b.name: [b"back"]}


@pytest.mark.parametrize("kind", BACKENDS)
def test_mismatched_regions_refused(kind: str) -> None:
    a, b, c = new_backend(kind, "a"), new_backend(kind, "b"), new_backend(kind, "c")
    buf_a, reg_a = make_kv(1)
    buf_b, reg_b = make_kv(2)
    buf_c, reg_c = make_kv(3)
    try:
        a.register_kv_memory(reg_a)
        b.register_kv_memory(reg_b[:1])  # one region instead of two
        half = [
            MemoryRegion(r.base_addr, r.num_blocks, r.block_len // 2, r.block_stride) for r in reg_c
        ]
        c.register_kv_memory(half)
        with pytest.raises(ValueError, match="region counts"):
            a.add_remote_agent(b.get_agent_metadata())
        with pytest.raises(ValueError, match="block_len"):
            a.add_remote_agent(c.get_agent_metadata())
        with pytest.raises(ValueError, match="unknown peer"):  # nothing half-added
            a.read_blocks(b.name, [0], [0])
    finally:
        for be in (a, b, c):
            be.shutdown()


@pytest.mark.parametrize("kind", BACKENDS)
def test_shutdown_idempotent(kind: str) -> None:
    a = new_backend(kind, "a")
    _, reg = make_kv(1)
    a.register_kv_memory(reg)
    a.shutdown()
    a.shutdown()
    b = new_backend(kind, "b")  # never registered: shutdown still fine
    b.shutdown()
    b.shutdown()


def test_factory_choice(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="pagedkv.transfer"):
        be = get_transfer_backend("auto-" + uuid.uuid4().hex[:8])
    try:
        assert be.kind == ("nixl" if NIXL_REASON is None else "tcp")
        expected = (
            "KV transfer backend: nixl (UCX)"
            if NIXL_REASON is None
            else "KV transfer backend: tcp (NIXL not importable:"
        )
        assert expected in caplog.text
    finally:
        be.shutdown()
    tcp = get_transfer_backend("forced-" + uuid.uuid4().hex[:8], "tcp", timeout_s=1.0)
    try:
        assert tcp.kind == "tcp"
    finally:
        tcp.shutdown()
    with pytest.raises(ValueError, match="unknown KV transfer backend"):
        get_transfer_backend("x", "rdma")


def test_factory_falls_back_to_tcp_without_nixl(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "nixl_cu12", None)  # what a machine without NIXL sees
    with caplog.at_level(logging.INFO, logger="pagedkv.transfer"):
        be = get_transfer_backend("fallback-" + uuid.uuid4().hex[:8])
    try:
        assert be.kind == "tcp"
        assert "KV transfer backend: tcp (NIXL not importable: ModuleNotFoundError" in caplog.text
    finally:
        be.shutdown()
    with pytest.raises(ImportError, match="nixl requested but not importable"):
        get_transfer_backend("x", "nixl")


# -- two processes ------------------------------------------------------------------------------


def _child(kind: str, name: str, to_parent: Any, from_parent: Any) -> None:
    """The remote engine: registers KV (pattern 7), exports metadata, then answers commands:
    ``wait_notif`` replies with the notifs and a snapshot of its KV taken when they arrived."""
    be = backend(kind, name)
    buf, regions = make_kv(7)
    be.register_kv_memory(regions)
    to_parent.put(be.get_agent_metadata())
    try:
        while True:
            cmd = from_parent.get(timeout=WAIT_S)
            if cmd == "stop":
                return
            deadline = time.monotonic() + WAIT_S
            while not (got := be.get_new_notifs()) and time.monotonic() < deadline:
                time.sleep(0.002)
            to_parent.put((got, buf.numpy().tobytes()))
    finally:
        be.shutdown()


class Child:
    """A spawned `_child`, killed in `close` whatever happened."""

    def __init__(self, kind: str) -> None:
        ctx = mp.get_context("spawn")
        self.to_parent, self.from_parent = ctx.Queue(), ctx.Queue()
        self.name = f"child-{uuid.uuid4().hex[:8]}"
        self.proc = ctx.Process(
            target=_child, args=(kind, self.name, self.to_parent, self.from_parent), daemon=True
        )
        self.proc.start()

    def metadata(self) -> bytes:
        return self.to_parent.get(timeout=WAIT_S)

    def wait_notif(
        self,
        initiator: tuple[KVTransferBackend, int] | None = None,
    ) -> tuple[dict[str, list[bytes]], torch.Tensor]:
        """The child's notifs and KV snapshot; polls ``initiator``'s transfer meanwhile."""
        self.from_parent.put("wait_notif")
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                got, raw = self.to_parent.get(timeout=0.005)
                break
            except queue.Empty:
                assert time.monotonic() < deadline, "child never answered"
                if initiator is not None:
                    initiator[0].check_xfer_state(initiator[1])
        snap, _ = make_kv(0)
        snap.view(-1).copy_(torch.frombuffer(bytearray(raw), dtype=torch.float32))
        return got, snap

    def close(self) -> None:
        if self.proc.is_alive():
            self.from_parent.put("stop")
            self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=10)


@pytest.mark.slow
@pytest.mark.parametrize("kind", BACKENDS)
def test_two_processes_read_write(kind: str) -> None:
    child = Child(kind)
    a = new_backend(kind, "parent")
    buf, regions = make_kv(1)
    expect, _ = make_kv(7)  # what the child holds before our write
    try:
        a.register_kv_memory(regions)
        peer = a.add_remote_agent(child.metadata())
        assert peer == child.name
        local, remote = [1, 4, 11], [14, 2, 6]
        before = buf.clone()
        h = a.read_blocks(peer, local, remote, notif=b"req-1:1")
        assert wait_done(a, h) == "DONE"
        a.release_xfer(h)
        assert blocks(buf, local) == blocks(expect, remote)
        assert blocks(buf, untouched(local)) == blocks(before, untouched(local))
        got, _ = child.wait_notif()
        assert got == {a.name: [b"req-1:1"]}

        w_local, w_remote = [0, 15], [3, 9]
        h = a.write_blocks(peer, w_local, w_remote, notif=b"req-2:1")
        got, snap = child.wait_notif(
            initiator=(a, h)
        )  # snapshot taken by the child when the notif arrived
        assert got == {a.name: [b"req-2:1"]}
        assert blocks(snap, w_remote) == blocks(buf, w_local)
        assert blocks(snap, untouched(w_remote)) == blocks(expect, untouched(w_remote))
        assert wait_done(a, h) == "DONE"
        a.release_xfer(h)

        h = a.write_blocks(peer, [], [], notif=b"req-3:1")  # a full hit: notif only
        assert wait_done(a, h) == "DONE"
        assert child.wait_notif(initiator=(a, h))[0] == {a.name: [b"req-3:1"]}
    finally:
        child.close()
        a.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("kind", BACKENDS)
def test_dead_peer_ends_err_within_timeout(kind: str) -> None:
    child = Child(kind)
    a = new_backend(kind, "parent", timeout_s=TIMEOUT_S)
    _, regions = make_kv(1)
    try:
        a.register_kv_memory(regions)
        peer = a.add_remote_agent(child.metadata())
        h = a.read_blocks(peer, [5], [6])  # the connection is up before the peer dies
        assert wait_done(a, h) == "DONE"
        a.release_xfer(h)
        child.proc.kill()
        child.proc.join(timeout=10)
        assert not child.proc.is_alive()
        for op in (a.read_blocks, a.write_blocks):
            t0 = time.monotonic()
            h = op(peer, [0, 1], [2, 3], notif=b"lost")
            assert time.monotonic() - t0 < 1.0, "starting a transfer must not block"
            assert wait_done(a, h, timeout=TIMEOUT_S + 5.0) == "ERR"
            assert time.monotonic() - t0 < TIMEOUT_S + 3.0
            a.release_xfer(h)
    finally:
        child.close()
        a.shutdown()
