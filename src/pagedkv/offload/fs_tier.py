"""FileSystemTier: chunks as files on a local (or shared) filesystem, crash-safe and reusable.

Directory layout (one namespace per config fingerprint)::

    <root>/pagedkv-<fingerprint>/config.json          what the fingerprint stands for
    <root>/pagedkv-<fingerprint>/<h0h1>/<h2h3>/<key hex>.kv
    <root>/pagedkv-<fingerprint>@tp_rank:R@dcpD/...     a TP/DCP rank's shard (`sharded`)

File format: a 4096-byte header block (`fingerprint.RecordHeader`, zero padded), then the
payload, zero padded to a multiple of 4096 (so O_DIRECT can read and write it whole). Every
file of one namespace has the same size, unless the tier has a codec (`offload.codec`): then
the payload is the encoded chunk (its length in the header, its checksum over the encoded
bytes), files are as long as their payload, and a record that does not decode is corrupt.

Durability: a store writes ``<final>.tmp.<pid>.<tid>`` (O_EXCL), fsyncs it, then ``os.replace``s
it onto the final name, so a final name only ever holds a complete file. A process killed
mid-write leaves a temp file, which the next start-up scan deletes (its pid is gone). The
scan indexes every complete file (oldest mtime = least recently used), so a restarted engine
reuses what is on disk. Every read verifies the header (fingerprint, key, length) and the
payload checksum: a torn, corrupted or foreign file is deleted and counted as a miss.

Capacity: ``capacity_bytes`` caps the bytes of indexed files (+ writes in flight); a store
evicts least recently used files first, and is dropped when it cannot fit. A full filesystem
(ENOSPC/EDQUOT/EFBIG) drops the store with a warning; serving goes on.

I/O: O_DIRECT when the filesystem accepts it (probed once per device; buffered otherwise),
through a page-aligned per-thread bounce buffer; buffered I/O reads straight into the host
slot with ``preadv``. Shared directories: the cap is per process; a key missing from this
process's index is looked up with one ``stat`` (files written by other instances are adopted).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pagedkv.core.events import MEDIUM_STORAGE
from pagedkv.offload.base import (
    ChunkItems,
    OffloadingEvent,
    OffloadKey,
    RateLimitedWarning,
    SecondaryTier,
    TierStats,
)
from pagedkv.offload.codec import CodecError, KVCodec
from pagedkv.offload.dual_queue_pool import DualQueueThreadPool
from pagedkv.offload.fingerprint import HEADER_SIZE, OffloadFingerprint, RecordError, RecordHeader

logger = logging.getLogger(__name__)
_warn = RateLimitedWarning(logger)

ALIGN = 4096
HEADER_BLOCK = 4096  # the payload starts here: aligned for O_DIRECT
_SUFFIX = ".kv"
_TMP = ".tmp."
_STALE_TMP_AGE_S = 3600.0  # a temp file this old is garbage even if its pid was reused
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_odirect_by_device: dict[int, bool] = {}
_odirect_lock = threading.Lock()


def _round_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def probe_odirect(directory: Path) -> bool:
    """Whether files in ``directory`` accept O_DIRECT writes; probed once per device."""
    if not hasattr(os, "O_DIRECT"):
        return False
    dev = os.stat(directory).st_dev
    with _odirect_lock:
        if dev in _odirect_by_device:
            return _odirect_by_device[dev]
        path = directory / f".odirect-probe.{os.getpid()}.{threading.get_ident()}"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
            try:
                with mmap.mmap(-1, ALIGN) as buf:  # page aligned, as O_DIRECT requires
                    ok = os.write(fd, buf) == ALIGN
            finally:
                os.close(fd)
        except OSError:
            ok = False
        finally:
            path.unlink(missing_ok=True)
        _odirect_by_device[dev] = ok
        return ok


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_all(fd: int, bufs: Sequence[Any]) -> None:
    """writev everything or raise (a short write means the disk filled up)."""
    views = [memoryview(b).cast("B") for b in bufs if memoryview(b).nbytes]
    while views:
        n = os.writev(fd, views)
        if n == 0:
            raise OSError(errno.ENOSPC, "short write")
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


class FileSystemTier(SecondaryTier):
    """See the module docstring."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        fingerprint: OffloadFingerprint | str,
        capacity_bytes: int,
        chunk_bytes: int,
        *,
        use_odirect: bool | None = None,
        fsync: bool = True,
        num_threads: int = 4,
        name: str = "disk",
        rank_namespace: str = "",
        codec: KVCodec | None = None,
    ) -> None:
        """``rank_namespace``: a TP/DCP shard's (``@tp_rank:R@dcpD``), appended to the directory
        name so each rank's files sit apart (the fingerprint already differs per rank).
        ``codec``: what chunks become on disk (raw by default); it must be the one the
        fingerprint names, so another codec's files sit in another directory."""
        super().__init__(name, MEDIUM_STORAGE, capacity_bytes)
        self.fingerprint = fingerprint if isinstance(fingerprint, str) else fingerprint.hexdigest
        self.chunk_bytes = chunk_bytes
        self.codec = codec if codec is not None and codec.name != "raw" else None
        self.file_bytes = HEADER_BLOCK + _round_up(chunk_bytes)
        # The largest file (one bounce buffer holds it): an encoded chunk may grow a little.
        self.max_file_bytes = (
            self.file_bytes
            if self.codec is None
            else HEADER_BLOCK + _round_up(self.codec.max_encoded_bytes(chunk_bytes))
        )
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.dir = Path(root) / f"pagedkv-{self.fingerprint}{rank_namespace}"
        self.dir.mkdir(parents=True, exist_ok=True)
        if isinstance(fingerprint, OffloadFingerprint):
            self._write_config(fingerprint)
        probed = probe_odirect(self.dir)
        if use_odirect and not probed:
            logger.warning("%s: O_DIRECT unsupported on %s, using buffered I/O", name, self.dir)
        self.odirect = probed if use_odirect is None else bool(use_odirect and probed)
        self._index: OrderedDict[OffloadKey, int] = OrderedDict()  # key → file bytes, LRU first
        self._used = 0  # bytes of indexed files
        self._reserved = 0  # bytes of writes in flight
        self._writing: set[OffloadKey] = set()
        self._made_dirs: set[Path] = set()
        self._local = threading.local()
        self.num_tmp_removed = 0
        self._scan()
        self.pool = DualQueueThreadPool(num_threads, f"{name}-io")
        self._readers = ThreadPoolExecutor(num_threads, thread_name_prefix=f"{name}-read")

    # ---------------------------------------------------------------------------- layout
    def path_for(self, key: OffloadKey) -> Path:
        h = key.hex()
        return self.dir / h[:2] / h[2:4] / f"{h}{_SUFFIX}"

    def _write_config(self, fp: OffloadFingerprint) -> None:
        path = self.dir / "config.json"
        if path.exists():
            return
        tmp = self.dir / f"config.json{_TMP}{os.getpid()}.{threading.get_ident()}"
        tmp.write_text(fp.to_json() + "\n")
        os.replace(tmp, path)

    def _scan(self) -> None:
        """Index complete files (oldest first), delete dead writers' temp files and files of
        the wrong size, then enforce the cap."""
        found: list[tuple[float, OffloadKey, int]] = []
        now = time.time()
        for sub1 in os.scandir(self.dir):
            if not sub1.is_dir() or len(sub1.name) != 2:
                continue
            for sub2 in os.scandir(sub1.path):
                if not sub2.is_dir():
                    continue
                for entry in os.scandir(sub2.path):
                    self._scan_entry(entry, now, found)
        found.sort()
        for _, key, size in found:
            self._index[key] = size
            self._used += size
        self._evict_to_fit(0)

    def _scan_entry(
        self, entry: os.DirEntry[str], now: float, found: list[tuple[float, OffloadKey, int]]
    ) -> None:
        name = entry.name
        try:
            st = entry.stat()
        except FileNotFoundError:
            return
        if _TMP in name:
            pid = name.rsplit(".", 2)[-2]
            if (
                not pid.isdigit()
                or not _pid_alive(int(pid))
                or now - st.st_mtime > _STALE_TMP_AGE_S
            ):
                self._unlink(Path(entry.path))
                self.num_tmp_removed += 1
            return
        if not name.endswith(_SUFFIX):
            return
        try:
            key = bytes.fromhex(name[: -len(_SUFFIX)])
        except ValueError:
            return
        if not self._plausible_size(st.st_size):  # torn or foreign: never index it
            self._unlink(Path(entry.path))
            self.stats.corrupted += 1
            return
        found.append((st.st_mtime, key, st.st_size))

    def _plausible_size(self, size: int) -> bool:
        if self.codec is None:
            return size == self.file_bytes
        return HEADER_BLOCK < size <= self.max_file_bytes and size % ALIGN == 0

    # ---------------------------------------------------------------------------- exists
    def exists_batch(self, keys: Sequence[OffloadKey]) -> list[bool]:
        out = [self._exists(k) for k in keys]
        with self._lock:
            self.stats.hits += sum(out)
            self.stats.misses += len(out) - sum(out)
        return out

    def _exists(self, key: OffloadKey) -> bool:
        with self._lock:
            if key in self._index:
                return True
        try:  # written by another process sharing the directory?
            size = self.path_for(key).stat().st_size
        except OSError:
            return False
        if not self._plausible_size(size):
            return False
        with self._lock:
            if key not in self._index:
                self._index[key] = size
                self._used += size
        return True

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._index

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    # ----------------------------------------------------------------------------- store
    def store_batch(self, items: ChunkItems) -> list[bool]:
        out = [self._store(key, data) for key, data in items]
        self._emit([key for (key, _), ok in zip(items, out) if ok], removed=False)
        return out

    def _store(self, key: OffloadKey, data: memoryview) -> bool:
        if data.nbytes != self.chunk_bytes:
            _warn(
                "size",
                "%s: refusing a %d B chunk (expected %d B)",
                self.name,
                data.nbytes,
                self.chunk_bytes,
            )
            self.count_dropped(1)
            return False
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return True
            if key in self._writing:  # another thread writes the same (content-addressed) bytes
                return True
        # Encoded here, on an I/O thread: never on a step's critical path.
        payload = data if self.codec is None else memoryview(self.codec.encode(data))
        size = HEADER_BLOCK + _round_up(payload.nbytes)
        with self._lock:
            if key in self._index or key in self._writing:
                return True
            victims = self._evict_to_fit(size)
            if victims is None:
                self.stats.store_failures += 1
                return False
            self._reserved += size
            self._writing.add(key)
        ok = False
        try:
            self._write_file(
                self.path_for(key),
                RecordHeader.for_payload(self.fingerprint, key, payload),
                payload,
                size,
            )
            ok = True
        except OSError as exc:
            topic = "full" if exc.errno in _DISK_FULL else "write"
            _warn(topic, "%s: dropping a store (%s)", self.name, exc)
        finally:
            with self._lock:
                self._writing.discard(key)
                self._reserved -= size
                if ok:
                    self._index[key] = size
                    self._used += size
                    self.stats.stores += 1
                    self.stats.bytes_written += data.nbytes
                else:
                    self.stats.store_failures += 1
        return ok

    def _evict_to_fit(self, nbytes: int) -> list[OffloadKey] | None:
        """(Lock held.) Evict LRU files until ``nbytes`` more fit; None (nothing evicted) if
        they cannot. Files are unlinked here: a reader that already opened one keeps reading."""
        if nbytes > self.capacity_bytes:
            return None
        excess = self._used + self._reserved + nbytes - self.capacity_bytes
        victims: list[OffloadKey] = []
        for key, size in self._index.items():
            if excess <= 0:
                break
            victims.append(key)
            excess -= size
        if excess > 0:
            return None
        for key in victims:
            self._used -= self._index.pop(key)
            self._unlink(self.path_for(key))
        self.stats.evictions += len(victims)
        if victims:
            self._events.append(OffloadingEvent(tuple(victims), self.medium, True))  # lock held
        return victims

    def _write_file(self, path: Path, header: RecordHeader, data: memoryview, size: int) -> None:
        if path.parent not in self._made_dirs:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._made_dirs.add(path.parent)
        tmp = f"{path}{_TMP}{os.getpid()}.{threading.get_ident()}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        if self.odirect:
            flags |= os.O_DIRECT
        try:
            fd = os.open(tmp, flags, 0o644)
        except FileExistsError:  # left by a dead thread of a process with our pid
            os.unlink(tmp)
            fd = os.open(tmp, flags, 0o644)
        except FileNotFoundError:  # the directory was removed under us: make it again
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, flags, 0o644)
        try:
            try:
                head = header.pack()
                if self.odirect:
                    buf = self._bounce()
                    buf[:HEADER_BLOCK] = head + bytes(HEADER_BLOCK - len(head))
                    end = HEADER_BLOCK + data.nbytes
                    buf[HEADER_BLOCK:end] = data
                    buf[end:size] = bytes(size - end)
                    _write_all(fd, [buf[:size]])
                else:
                    pad = bytes(size - HEADER_BLOCK - data.nbytes)
                    _write_all(fd, [head + bytes(HEADER_BLOCK - len(head)), data, pad])
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            self._unlink(Path(tmp))
            raise

    def _bounce(self) -> memoryview:
        """This thread's page-aligned buffer of one file (O_DIRECT needs aligned memory)."""
        buf = getattr(self._local, "buf", None)
        if buf is None:
            self._local.mm = mmap.mmap(-1, self.max_file_bytes)
            buf = self._local.buf = memoryview(self._local.mm)
        return buf

    # ------------------------------------------------------------------------------ load
    def load_batch(self, items: ChunkItems) -> list[bool]:
        """Load chunks in parallel (queue depth > 1: one synchronous read at a time leaves a
        disk or SSD mostly idle); each reader thread has its own O_DIRECT bounce buffer."""
        if len(items) <= 1:
            return [self._load(key, out) for key, out in items]
        return list(self._readers.map(lambda item: self._load(*item), items))

    def _load(self, key: OffloadKey, out: memoryview) -> bool:
        path = self.path_for(key)
        ok = False
        try:
            self._read_verified(path, key, out)
            ok = True
        except FileNotFoundError:
            self._forget(key)
        except (RecordError, CodecError) as exc:
            _warn("corrupt", "%s: dropping %s: %s", self.name, path.name, exc)
            self._unlink(path)
            self._forget(key)
            with self._lock:
                self.stats.corrupted += 1
        except OSError as exc:
            _warn("read", "%s: read of %s failed (%s)", self.name, path.name, exc)
        with self._lock:
            if ok:
                self.stats.loads += 1
                self.stats.bytes_read += out.nbytes
                if key in self._index:
                    self._index.move_to_end(key)
            else:
                self.stats.load_failures += 1
        return ok

    def _read_verified(self, path: Path, key: OffloadKey, out: memoryview) -> None:
        if out.nbytes != self.chunk_bytes:
            raise RecordError(f"destination holds {out.nbytes} B, chunks are {self.chunk_bytes} B")
        if self.codec is not None:
            self._read_encoded(path, key, out)
            return
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | (os.O_DIRECT if self.odirect else 0)
        fd = os.open(path, flags)
        try:
            if self.odirect:
                buf = self._bounce()[: self.file_bytes]
                n = os.preadv(fd, [buf], 0)
                payload = buf[HEADER_BLOCK : HEADER_BLOCK + self.chunk_bytes]
                head = buf[:HEADER_SIZE]
            else:
                head_buf = bytearray(HEADER_BLOCK)
                n = os.preadv(fd, [head_buf, out], 0)
                payload, head = out, memoryview(head_buf)[:HEADER_SIZE]
        finally:
            os.close(fd)
        if n < HEADER_BLOCK + self.chunk_bytes:
            raise RecordError(f"short file ({n} B): torn write")
        RecordHeader.unpack(head).verify(self.fingerprint, key, payload)
        if payload is not out:
            out[:] = payload

    def _read_encoded(self, path: Path, key: OffloadKey, out: memoryview) -> None:
        """A codec's record: the whole file (its size varies), verified, then decoded."""
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | (os.O_DIRECT if self.odirect else 0)
        fd = os.open(path, flags)
        try:
            size = os.fstat(fd).st_size
            if not self._plausible_size(size):
                raise RecordError(f"file of {size} B: torn or foreign")
            buf = self._bounce()[:size] if self.odirect else memoryview(bytearray(size))
            n = os.preadv(fd, [buf], 0)
        finally:
            os.close(fd)
        if n < size:
            raise RecordError(f"short file ({n} B): torn write")
        header = RecordHeader.unpack(buf[:HEADER_SIZE])
        if header.payload_len > size - HEADER_BLOCK:
            raise RecordError("payload longer than the file")
        payload = buf[HEADER_BLOCK : HEADER_BLOCK + header.payload_len]
        header.verify(self.fingerprint, key, payload)
        assert self.codec is not None
        self.codec.decode(payload, out)

    def _forget(self, key: OffloadKey) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size

    @staticmethod
    def _unlink(path: Path) -> None:
        try:
            path.unlink()
        except OSError:
            pass

    def shutdown(self, timeout: float = 5.0) -> None:
        super().shutdown(timeout)
        self._readers.shutdown(wait=True)

    def get_stats(self) -> TierStats:
        with self._lock:
            self.stats.usage_bytes = self._used
        return super().get_stats()
