"""vAttention-style virtual KV memory on Linux CPUs (Prabhu et al., ASPLOS 2025; seed §9).

The paged cache finds a request's K/V through a block table. Here each request gets one
*contiguous virtual* range per (layer, KV head) instead, and physical pages are mapped into
it as the request grows, so attention reads ``[seq_len, C]`` rows with no indirection. The
scheduler's block pool stays the only allocator: a block id *is* a physical page id.

Two mappings of one ``memfd`` (anonymous shared memory):

* **Physical** (``physical [L, H, B, N, C]``, the paged layout LHBNC): page ``(l, h, b)`` is
  bytes ``((l·H + h)·B + b)·P`` of the memfd, ``P = N·C·elem`` (``N`` tokens of one KV head,
  K|V contiguous per token: the paged cache's C). Block copies, offload tiers and transfers
  move these pages exactly as they move a paged cache's.
* **Virtual** (``virtual [L, H, R, T, C]``): ``R = max_rows`` request rows of ``T =
  max_blocks·N`` tokens, reserved ``PROT_NONE`` + ``MAP_NORESERVE`` (address space only, so
  the reservation may exceed physical memory). Row ``r``'s block ``i`` of layer ``l``, head
  ``h`` is page ``(l, h, block_ids[i])`` mapped ``MAP_FIXED | MAP_SHARED`` at
  ``((l·H + h)·R + r)·T·C·elem + i·P``.

Invariants (`check_invariants`; the stateful test drives them):

* a row's mapped blocks are a prefix of its request's block table, pages ``[0, first
  writable)`` read-only (complete tokens: a prefix hit or an earlier step's), the rest
  read-write;
* a block is mapped writable in at most one row (two requests share only complete pages);
* a released row maps nothing (its range is ``PROT_NONE`` again, anonymous: reading it
  faults, which is why attention never reads past ``seq_len``).

``mmap``/``mprotect`` are called through libc (Python's ``mmap`` module cannot map at a fixed
address). Linux only; Linux's constants are spelled below.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import math
import os
import sys
from dataclasses import dataclass, field

import torch

# Linux mmap(2) flags and protections (x86-64 and arm64 share these values).
PROT_NONE, PROT_READ, PROT_WRITE = 0x0, 0x1, 0x2
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS, MAP_NORESERVE = 0x1, 0x2, 0x10, 0x20, 0x4000
MAP_FAILED = ctypes.c_void_p(-1).value
OS_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

logger = logging.getLogger(__name__)


def max_map_count() -> int:
    """The kernel's limit on a process's mappings (``vm.max_map_count``; 65530 by default).
    Every page mapped at a scattered physical offset is one mapping (consecutive ones merge)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except OSError:
        return 65530


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def supported() -> str | None:
    """Why this process cannot build a virtual KV cache, or None (Linux with memfd)."""
    if not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"):
        return "kv_cache_memory_mode='vmm' needs Linux (memfd_create and mmap MAP_FIXED)"
    return None


@dataclass(frozen=True, slots=True)
class VMMGeometry:
    """Shape of a virtual KV cache: ``num_layers`` × ``num_kv_heads`` planes, ``num_blocks``
    physical pages per plane of ``block_size`` tokens × ``token_elems`` elements (K then V),
    ``max_rows`` request rows of ``max_blocks`` pages."""

    num_layers: int
    num_kv_heads: int
    num_blocks: int
    block_size: int
    token_elems: int
    elem_size: int
    max_rows: int
    max_blocks: int

    @property
    def page_bytes(self) -> int:
        return self.block_size * self.token_elems * self.elem_size

    @property
    def row_bytes(self) -> int:
        return self.max_blocks * self.page_bytes

    @property
    def planes(self) -> int:
        return self.num_layers * self.num_kv_heads

    def __post_init__(self) -> None:
        if self.page_bytes % OS_PAGE:
            raise ValueError(
                f"a page of {self.block_size} tokens x {self.token_elems * self.elem_size} bytes "
                f"= {self.page_bytes} bytes is not a multiple of the OS page ({OS_PAGE})"
            )
        for name in ("num_layers", "num_kv_heads", "num_blocks", "max_rows", "max_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"VMMGeometry.{name} must be >= 1")


def tokens_per_page(page_bytes: int, token_bytes: int) -> int:
    """Tokens of one KV head in a page of ``page_bytes`` (``token_bytes``: K+V of one token of
    one head). Raises ValueError unless the page is a multiple of the OS page holding a whole
    number of tokens (the virtual rows must tile pages exactly)."""
    if page_bytes < OS_PAGE or page_bytes % OS_PAGE:
        raise ValueError(f"vmm_page_size={page_bytes} must be a positive multiple of {OS_PAGE}")
    if page_bytes % token_bytes:
        raise ValueError(
            f"vmm_page_size={page_bytes} does not hold a whole number of tokens of "
            f"{token_bytes} bytes (K+V of one KV head); use a multiple of "
            f"{math.lcm(OS_PAGE, token_bytes)}"
        )
    return page_bytes // token_bytes


@dataclass(slots=True)
class VirtualKVCache:
    """One memfd of physical pages and one virtual reservation (see the module docstring).

    ``rows[r]``: the block ids mapped into row ``r`` (index ``i`` at virtual page ``i``);
    ``first_writable[r]``: pages of row ``r`` before it are read-only. ``num_map_calls``
    counts mmap/mprotect calls (the allocator's cost, reported by the benchmark)."""

    geometry: VMMGeometry
    dtype: torch.dtype
    fd: int = -1
    physical_addr: int = 0
    virtual_addr: int = 0
    physical: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    virtual: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    rows: list[list[int]] = field(default_factory=list)
    first_writable: list[int] = field(default_factory=list)
    num_map_calls: int = 0
    _libc: ctypes.CDLL | None = None

    @classmethod
    def create(cls, geometry: VMMGeometry, dtype: torch.dtype) -> VirtualKVCache:
        """Create the memfd (sparse: physical memory is committed as pages are written) and
        both mappings. Raises OSError if the kernel refuses either."""
        why = supported()
        if why is not None:
            raise OSError(why)
        g = geometry
        elem = torch.empty(0, dtype=dtype).element_size()
        if elem != g.elem_size:
            raise ValueError(f"{dtype} has {elem}-byte elements, the geometry says {g.elem_size}")
        self = cls(g, dtype, _libc=_libc())
        phys_bytes = g.planes * g.num_blocks * g.page_bytes
        self.fd = os.memfd_create("pagedkv-kv", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, phys_bytes)
            self.physical_addr = self._mmap(
                None, phys_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, self.fd, 0
            )
            virt_bytes = g.planes * g.max_rows * g.row_bytes
            self.virtual_addr = self._mmap(
                None, virt_bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0
            )
        except BaseException:
            self.close()
            raise
        n, c = g.block_size, g.token_elems
        self.physical = _tensor_at(self.physical_addr, phys_bytes, dtype).view(
            g.num_layers, g.num_kv_heads, g.num_blocks, n, c
        )
        self.virtual = _tensor_at(self.virtual_addr, virt_bytes, dtype).view(
            g.num_layers, g.num_kv_heads, g.max_rows, g.max_blocks * n, c
        )
        self.rows = [[] for _ in range(g.max_rows)]
        self.first_writable = [0] * g.max_rows
        # Worst case: every page of the pool mapped once at a scattered offset (prefix
        # sharing maps some twice; a row's consecutive pages merge into one mapping).
        worst = g.planes * (g.num_blocks + g.max_rows)
        if worst > 0.9 * max_map_count():
            logger.warning(
                "vmm: up to %d mappings for %d pages x %d (layer, KV head) planes, near "
                "vm.max_map_count=%d: raise it (sysctl) or use larger vmm pages",
                worst,
                g.num_blocks,
                g.planes,
                max_map_count(),
            )
        return self

    # ---- addresses ---------------------------------------------------------------------------

    def _paddr(self, plane: int, block: int) -> int:
        """memfd offset of page ``block`` of plane ``plane`` (= layer·H + head)."""
        return (plane * self.geometry.num_blocks + block) * self.geometry.page_bytes

    def _vaddr(self, plane: int, row: int, index: int) -> int:
        g = self.geometry
        return self.virtual_addr + (plane * g.max_rows + row) * g.row_bytes + index * g.page_bytes

    def _mmap(self, addr: int | None, size: int, prot: int, flags: int, fd: int, off: int) -> int:
        assert self._libc is not None
        self.num_map_calls += 1
        got = self._libc.mmap(addr, size, prot, flags, fd, off)
        if got in (None, MAP_FAILED) or (addr is not None and got != addr):
            err = ctypes.get_errno()
            hint = ""
            if err == errno.ENOMEM:
                hint = (
                    f" (a process may hold vm.max_map_count={max_map_count()} mappings; "
                    "raise it, or use larger vmm pages)"
                )
            raise OSError(err, f"mmap of {size} bytes failed: {os.strerror(err)}{hint}")
        return int(got)

    def _mprotect(self, addr: int, size: int, prot: int) -> None:
        assert self._libc is not None
        self.num_map_calls += 1
        if self._libc.mprotect(addr, size, prot):
            err = ctypes.get_errno()
            raise OSError(err, f"mprotect failed: {os.strerror(err)}")

    # ---- mapping -----------------------------------------------------------------------------

    def map_blocks(self, row: int, block_ids: list[int], first_writable: int) -> int:
        """Make row ``row`` map ``block_ids`` (its request's block table): blocks past those
        already mapped are mapped in (runs of consecutive ids with one call per plane), and
        pages before ``first_writable`` become read-only. If the mapped blocks are not a
        prefix of ``block_ids`` (the request was preempted and got new blocks) the row is
        remapped from scratch. Returns the number of blocks newly mapped."""
        g = self.geometry
        if len(block_ids) > g.max_blocks:
            raise ValueError(f"{len(block_ids)} blocks exceed a row's {g.max_blocks}")
        mapped = self.rows[row]
        if mapped != block_ids[: len(mapped)]:
            self.release(row)
            mapped = self.rows[row]
        first_writable = min(first_writable, len(block_ids))
        old_fw = self.first_writable[row]
        start = len(mapped)
        i = start
        while i < len(block_ids):
            j = i + 1  # a run of consecutive physical pages maps with one call per plane
            while j < len(block_ids) and block_ids[j] == block_ids[j - 1] + 1:
                j += 1
            for plane in range(g.planes):
                lo, hi = max(i, first_writable), j  # [lo, hi) writable, [i, lo) read-only
                if lo > i:
                    self._map(plane, row, i, block_ids[i], min(lo, j) - i, PROT_READ)
                if hi > lo:
                    self._map(plane, row, lo, block_ids[lo], hi - lo, PROT_READ | PROT_WRITE)
            i = j
        mapped.extend(block_ids[start:])
        # Pages that were writable and now hold only complete tokens become read-only.
        lo, hi = old_fw, min(first_writable, start)
        if hi > lo:
            for plane in range(g.planes):
                self._mprotect(self._vaddr(plane, row, lo), (hi - lo) * g.page_bytes, PROT_READ)
        self.first_writable[row] = max(old_fw, first_writable)
        return len(block_ids) - start

    def _map(self, plane: int, row: int, index: int, block: int, count: int, prot: int) -> None:
        size = count * self.geometry.page_bytes
        addr = self._vaddr(plane, row, index)
        self._mmap(addr, size, prot, MAP_SHARED | MAP_FIXED, self.fd, self._paddr(plane, block))

    def release(self, row: int) -> None:
        """Unmap every page of row ``row`` (its range becomes PROT_NONE reservation again)."""
        n = len(self.rows[row])
        if n:
            g = self.geometry
            for plane in range(g.planes):
                self._mmap(
                    self._vaddr(plane, row, 0),
                    n * g.page_bytes,
                    PROT_NONE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
                    -1,
                    0,
                )
        self.rows[row] = []
        self.first_writable[row] = 0

    # ---- accounting --------------------------------------------------------------------------

    def mapped_blocks(self) -> set[int]:
        """Distinct physical blocks mapped by some row."""
        return {b for r in self.rows for b in r}

    def mapped_bytes(self) -> int:
        """Physical bytes the rows map, each page counted once (shared pages once)."""
        return len(self.mapped_blocks()) * self.geometry.planes * self.geometry.page_bytes

    def check_invariants(self) -> None:
        """Assert the module's invariants (see its docstring)."""
        g = self.geometry
        writers: dict[int, int] = {}
        for r, blocks in enumerate(self.rows):
            assert len(blocks) <= g.max_blocks, (r, len(blocks))
            assert all(0 < b < g.num_blocks for b in blocks), (r, blocks)
            assert len(set(blocks)) == len(blocks), f"row {r} maps a block twice: {blocks}"
            assert self.first_writable[r] <= len(blocks) or not blocks, r
            for b in blocks[self.first_writable[r] :]:
                assert b not in writers, f"block {b} writable in rows {writers[b]} and {r}"
                writers[b] = r

    def close(self) -> None:
        """Unmap both ranges and close the memfd (the tensors must not be used after)."""
        libc, g = self._libc, self.geometry
        if libc is not None:
            if self.virtual_addr:
                libc.munmap(self.virtual_addr, g.planes * g.max_rows * g.row_bytes)
            if self.physical_addr:
                libc.munmap(self.physical_addr, g.planes * g.num_blocks * g.page_bytes)
        self.virtual_addr = self.physical_addr = 0
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.physical = self.virtual = torch.empty(0)
        self.rows = [[] for _ in range(g.max_rows)]

    def __del__(self) -> None:  # the engine holds one for its life; tests create many
        try:
            self.close()
        except Exception:
            pass


def _tensor_at(addr: int, size: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over ``size`` bytes at ``addr`` (no copy; the caller keeps the mapping alive)."""
    buf = (ctypes.c_char * size).from_address(addr)
    return torch.frombuffer(buf, dtype=torch.uint8, count=size).view(dtype)


def kernel_mappings(start: int, size: int) -> list[tuple[int, int, str]]:
    """``(lo, hi, perms)`` of the process's mappings that overlap ``[start, start+size)``, read
    from ``/proc/self/maps`` (what the kernel holds, for tests: "rw-s" is a writable shared
    page)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if hi > start and lo < start + size:
                out.append((max(lo, start), min(hi, start + size), perms))
    return out
