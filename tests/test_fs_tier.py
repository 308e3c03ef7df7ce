"""FileSystemTier and DualQueueThreadPool on real files: round trips in both I/O modes,
restart reuse, corruption/torn/foreign detection, kill -9 during writes, a size cap, and a
genuinely full filesystem."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedkv.offload.base import make_offload_key
from pagedkv.offload.dual_queue_pool import DualQueueThreadPool
from pagedkv.offload.fingerprint import OffloadFingerprint
from pagedkv.offload.fs_tier import HEADER_BLOCK, FileSystemTier, probe_odirect

CHUNK = 64 * 1024 + 100  # deliberately not a multiple of 4096
FP = OffloadFingerprint("test-model", "float32", 16, "LBNHC", 2, 2, 64)
SRC = str(Path(__file__).resolve().parents[1] / "src")


def key(i: int) -> bytes:
    return make_offload_key(i.to_bytes(32, "big"))


def payload(i: int, size: int = CHUNK) -> bytes:
    return random.Random(i).randbytes(size)


def store(tier: FileSystemTier, ids: list[int]) -> list[bool]:
    return tier.store_batch([(key(i), memoryview(payload(i))) for i in ids])


def load(tier: FileSystemTier, i: int) -> bytes | None:
    out = bytearray(tier.chunk_bytes)
    return bytes(out) if tier.load_batch([(key(i), memoryview(out))])[0] else None


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture(params=[True, False], ids=["odirect", "buffered"])
def odirect(request: pytest.FixtureRequest, tmp_path: Path) -> bool:
    if request.param and not probe_odirect(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    return request.param


def make_tier(root: Path, capacity: int = 10**8, **kw) -> FileSystemTier:
    return FileSystemTier(
        root, kw.pop("fp", FP), capacity, kw.pop("chunk", CHUNK), num_threads=2, **kw
    )


def test_roundtrip_layout_and_format(root: Path, odirect: bool):
    tier = make_tier(root, use_odirect=odirect)
    try:
        assert tier.odirect is odirect
        assert tier.exists_batch([key(1), key(2)]) == [False, False]
        assert store(tier, [1, 2]) == [True, True]
        assert store(tier, [1]) == [True]  # content-addressed: already there
        assert tier.exists_batch([key(1), key(2), key(3)]) == [True, True, False]
        assert load(tier, 1) == payload(1) and load(tier, 2) == payload(2) and load(tier, 3) is None
        path = tier.path_for(key(1))
        h = key(1).hex()
        assert path == root / f"pagedkv-{FP.hexdigest}" / h[:2] / h[2:4] / f"{h}.kv"
        assert path.stat().st_size == tier.file_bytes == HEADER_BLOCK + 69632
        assert path.read_bytes()[HEADER_BLOCK : HEADER_BLOCK + CHUNK] == payload(1)
        assert json.loads((tier.dir / "config.json").read_text())["model"] == "test-model"
        s = tier.get_stats()
        assert (s.stores, s.loads, s.load_failures, s.hits, s.misses) == (2, 2, 1, 2, 3)
        assert s.usage_bytes == 2 * tier.file_bytes and s.bytes_written == 2 * CHUNK
        assert [e.removed for e in tier.take_events()] == [False, False]
        assert not list(tier.dir.rglob("*.tmp.*"))
    finally:
        tier.shutdown()


def test_wrong_sized_chunks_are_refused(root: Path):
    tier = make_tier(root)
    assert tier.store_batch([(key(1), memoryview(b"short"))]) == [False]
    assert tier.load_batch([(key(1), memoryview(bytearray(10)))]) == [False]
    tier.shutdown()


def test_restart_reuses_files_in_lru_order(root: Path):
    tier = make_tier(root, capacity=10 * (CHUNK + 8192))
    store(tier, [1, 2, 3])
    tier.shutdown()
    os.utime(tier.path_for(key(2)), (1, 1))  # the oldest file is the least recently used
    again = make_tier(root, capacity=10 * (CHUNK + 8192))
    assert len(again) == 3 and again.exists_batch([key(1), key(2), key(3)]) == [True] * 3
    assert all(load(again, i) == payload(i) for i in (1, 2, 3))
    small = make_tier(root, capacity=2 * again.file_bytes)  # a lower cap evicts at start-up
    assert len(small) == 2 and key(2) not in small and not again.path_for(key(2)).exists()
    again.shutdown()
    small.shutdown()


@pytest.mark.parametrize("where", ["payload", "header", "padding_is_not_checked"])
def test_flipped_bytes_are_detected_and_dropped(root: Path, where: str):
    tier = make_tier(root)
    store(tier, [1, 2])
    path = tier.path_for(key(1))
    offset = {
        "payload": HEADER_BLOCK + 1234,
        "header": 50,
        "padding_is_not_checked": tier.file_bytes - 1,
    }[where]
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))
    if where == "padding_is_not_checked":
        assert load(tier, 1) == payload(1)
        return
    assert load(tier, 1) is None
    assert not path.exists() and key(1) not in tier
    assert tier.exists_batch([key(1)]) == [False]
    assert load(tier, 2) == payload(2)  # the neighbour is untouched
    s = tier.get_stats()
    assert s.corrupted == 1 and s.load_failures == 1
    tier.shutdown()


def test_torn_and_foreign_files(root: Path):
    tier = make_tier(root)
    store(tier, [1, 2, 3])
    # torn: truncated after indexing (a bad disk, or someone else's partial copy)
    with open(tier.path_for(key(1)), "r+b") as f:
        f.truncate(HEADER_BLOCK + 100)
    assert load(tier, 1) is None and not tier.path_for(key(1)).exists()
    # another key's bytes under this key's name
    shutil.copy(tier.path_for(key(2)), tier.path_for(key(3)))
    assert load(tier, 3) is None and not tier.path_for(key(3)).exists()
    # another configuration's file copied into this namespace
    other = make_tier(root, fp=OffloadFingerprint("other", "float32", 16, "LBNHC", 2, 2, 64))
    store(other, [4])
    foreign = tier.path_for(key(4))
    foreign.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(other.path_for(key(4)), foreign)
    assert tier.exists_batch([key(4)]) == [True]  # adopted by stat...
    assert load(tier, 4) is None and not foreign.exists()  # ...and rejected on read
    assert load(other, 4) == payload(4)
    assert tier.get_stats().corrupted == 3
    # a torn file on disk at start-up is deleted by the scan, never indexed
    with open(tier.path_for(key(2)), "r+b") as f:
        f.truncate(1000)
    tier.shutdown()
    again = make_tier(root)
    assert key(2) not in again and not again.path_for(key(2)).exists() and len(again) == 0
    again.shutdown()
    other.shutdown()


def test_startup_scan_removes_dead_writers_temp_files(root: Path):
    tier = make_tier(root)
    store(tier, [1])
    final = tier.path_for(key(1))
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    stale = Path(f"{final}.tmp.{dead}.123")
    live = Path(f"{final}.tmp.{os.getpid()}.456")  # a writer of this very process: keep it
    stale.write_bytes(b"partial")
    live.write_bytes(b"partial")
    tier.shutdown()
    again = make_tier(root)
    assert not stale.exists() and live.exists() and again.num_tmp_removed == 1
    assert load(again, 1) == payload(1)
    again.shutdown()


def test_size_cap_evicts_least_recently_used(root: Path):
    probe = make_tier(root / "probe")
    file_bytes = probe.file_bytes
    probe.shutdown()
    tier = make_tier(root, capacity=3 * file_bytes)
    store(tier, [1, 2, 3])
    assert load(tier, 1) == payload(1)  # 1 is now the most recent
    store(tier, [4, 5])
    assert tier.exists_batch([key(i) for i in range(1, 6)]) == [True, False, False, True, True]
    assert not tier.path_for(key(2)).exists()
    s = tier.get_stats()
    assert s.evictions == 2 and s.usage_bytes == 3 * file_bytes
    removed = [e for e in tier.take_events() if e.removed]
    assert [set(e.keys) for e in removed] == [{key(2)}, {key(3)}]
    tiny = make_tier(root / "tiny", capacity=file_bytes - 1)  # nothing fits: dropped, counted
    assert store(tiny, [1]) == [False] and tiny.get_stats().store_failures == 1
    tier.shutdown()
    tiny.shutdown()


def test_shared_directory_adopts_files_of_another_instance(root: Path):
    a, b = make_tier(root), make_tier(root)
    store(a, [7])
    assert key(7) not in b and b.exists_batch([key(7)]) == [True] and key(7) in b
    assert load(b, 7) == payload(7)
    a.shutdown()
    b.shutdown()


def test_concurrent_stores_and_loads_of_the_same_keys(root: Path):
    tier = make_tier(root, capacity=6 * (CHUNK + 8192))
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(40):
            i = rng.randrange(12)
            if rng.random() < 0.5:
                store(tier, [i])
            else:
                got = load(tier, i)
                if got is not None and got != payload(i):
                    errors.append(f"wrong bytes for {i}")

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert tier.get_stats().corrupted == 0 and not list(tier.dir.rglob("*.tmp.*"))
    assert len(tier) <= 6
    tier.shutdown()


# ------------------------------------------------------------------------------ crash safety
_WRITER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {src!r})
    from pagedkv.offload.base import make_offload_key
    from pagedkv.offload.fs_tier import FileSystemTier
    root, start, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    tier = FileSystemTier(root, {fp!r}, 10**10, chunk, num_threads=1)
    i = start
    while True:
        data = i.to_bytes(16, "big") * (chunk // 16)
        assert tier.store_batch([(make_offload_key(i.to_bytes(32, "big")), memoryview(data))]) == [True]
        i += 1
""")


def _wait_for(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.0005)
    return False


def test_kill_9_during_writes_never_yields_a_corrupt_block(root: Path):
    """A writer of 8 MiB chunks (fsync'd) is SIGKILLed while the temp file of its 4th chunk
    exists, i.e. mid-write; a fresh tier on the same directory must drop the partial file,
    keep every completed chunk and load each one exactly. Three rounds on one directory."""
    chunk = 8 << 20
    script = _WRITER.format(src=SRC, fp=FP.hexdigest)
    probe = FileSystemTier(root, FP.hexdigest, 10**10, chunk, num_threads=1)
    complete: set[int] = set()
    for round_ in range(3):
        start = round_ * 1000
        proc = subprocess.Popen([sys.executable, "-c", script, str(root), str(start), str(chunk)])
        victim = probe.path_for(key(start + 3))
        torn = f"{victim.name}.tmp.{proc.pid}.*"
        try:
            assert _wait_for(lambda: victim.parent.is_dir() and any(victim.parent.glob(torn))), (
                "never wrote"
            )
        finally:
            proc.kill()  # SIGKILL: no cleanup, no flush
            proc.wait()
        complete |= {start, start + 1, start + 2}
        tier = FileSystemTier(root, FP.hexdigest, 10**10, chunk, num_threads=1)
        assert not list(tier.dir.rglob("*.tmp.*"))
        assert (
            tier.num_tmp_removed == 1 or key(start + 3) in tier
        )  # (unless the rename won the race)
        indexed = {int.from_bytes(k[:32], "big") for k in tier._index}
        assert complete <= indexed
        for i in indexed:
            out = bytearray(chunk)
            assert tier.load_batch([(key(i), memoryview(out))]) == [True]
            assert out == i.to_bytes(16, "big") * (chunk // 16)
        assert tier.get_stats().corrupted == 0
        tier.shutdown()
    probe.shutdown()


# -------------------------------------------------------------------------------- disk full
_FULL_DISK = textwrap.dedent("""
    import json, logging, random, resource, signal, sys
    sys.path.insert(0, {src!r})
    from pagedkv.offload.base import make_offload_key
    from pagedkv.offload.fs_tier import FileSystemTier
    root, chunk, fsize = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if fsize:  # no small filesystem could be mounted: cap the file size instead (EFBIG)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    warnings = []
    class H(logging.Handler):
        def emit(self, record): warnings.append(record.getMessage())
    logging.getLogger("pagedkv").addHandler(H())
    tier = FileSystemTier(root, {fp!r}, 10**9, chunk, num_threads=2)
    key = lambda i: make_offload_key(i.to_bytes(32, "big"))
    data = lambda i: random.Random(i).randbytes(chunk)
    stored = tier.store_batch([(key(i), memoryview(data(i))) for i in range(8)])
    loads = []
    for i in range(8):
        out = bytearray(chunk)
        loads.append(tier.load_batch([(key(i), memoryview(out))])[0] and out == data(i))
    again = tier.store_batch([(key(100), memoryview(data(100)))])
    import os
    tmp = [p for d, _, fs in os.walk(root) for p in fs if ".tmp." in p]
    print(json.dumps(dict(stored=stored, loads=loads, again=again, warnings=warnings, tmp=tmp,
                          failures=tier.get_stats().store_failures)))
""")


@pytest.fixture
def small_fs() -> Iterator[tuple[str, int]]:
    """A 1 MiB tmpfs mounted for this test (root only), else a plain directory and a file size
    limit that makes every write fail with EFBIG."""
    path = tempfile.mkdtemp(prefix="pagedkv-full-")
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", path], capture_output=True
        ).returncode
        == 0
        if shutil.which("mount")
        else False
    )
    try:
        yield path, (0 if mounted else 64 * 1024)
    finally:
        if mounted:
            subprocess.run(["umount", path], check=False)
        shutil.rmtree(path, ignore_errors=True)


def test_full_disk_drops_stores_with_a_warning_and_keeps_serving(small_fs: tuple[str, int]):
    path, fsize = small_fs
    chunk = 256 * 1024
    script = _FULL_DISK.format(src=SRC, fp=FP.hexdigest)
    res = subprocess.run(
        [sys.executable, "-c", script, path, str(chunk), str(fsize)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    n_ok = sum(out["stored"])
    assert n_ok < 8 and out["failures"] >= 8 - n_ok + 1  # later stores (and the retry) dropped
    assert out["stored"] == [True] * n_ok + [False] * (8 - n_ok)
    assert out["loads"] == out["stored"]  # what was stored is served exactly
    assert out["again"] == [False] and out["tmp"] == []
    assert any("dropping a store" in w for w in out["warnings"])
    if not fsize:
        assert n_ok >= 2  # the tmpfs held a few files before it filled up


# ------------------------------------------------------------------------ DualQueueThreadPool
def test_dual_queue_runs_reads_before_writes():
    pool = DualQueueThreadPool(1)
    gate = threading.Event()
    order: list[str] = []
    pool.submit_write(gate.wait)
    time.sleep(0.05)  # the only thread is now blocked in the gate
    futures = [
        pool.submit_write(order.append, "w1"),
        pool.submit_read(order.append, "r1"),
        pool.submit_write(order.append, "w2"),
        pool.submit_read(order.append, "r2"),
    ]
    assert pool.num_pending_reads == 2 and pool.num_pending_writes == 2
    gate.set()
    assert pool.wait_idle(5)
    assert order == ["r1", "r2", "w1", "w2"] and all(f.done() for f in futures)
    pool.shutdown()


def test_dual_queue_write_thread_prevents_starvation_and_errors_reach_futures():
    pool = DualQueueThreadPool(2)
    stop = threading.Event()
    reads = [pool.submit_read(stop.wait, 0.01) for _ in range(200)]
    wrote = pool.submit_write(lambda: "done")
    assert wrote.result(timeout=1) == "done"  # not after 200 reads × 10 ms
    assert not all(r.done() for r in reads)
    boom = pool.submit_read(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        boom.result(timeout=5)
    pool.shutdown(cancel_pending=True)
    with pytest.raises(RuntimeError):
        pool.submit_read(print)


def test_concurrent_batched_reads_are_exact(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    """Several batched reads in flight at once on the read queue all return the stored bytes.
    (Read throughput against a sequential read is a figure of benchmarks/bench_offload.py,
    not a timed test.)"""
    caplog.set_level(logging.WARNING)
    chunk, n = 720 * 1024, 64
    tier = FileSystemTier(
        tmp_path / "c", FP, 10**10, chunk, num_threads=4, fsync=False, use_odirect=False
    )
    blobs = [random.Random(i).randbytes(chunk) for i in range(n)]
    assert all(tier.store_batch([(key(i), memoryview(b)) for i, b in enumerate(blobs)]))
    outs = [bytearray(chunk) for _ in range(n)]
    items = [(key(i), memoryview(outs[i])) for i in range(n)]
    futs = [tier.pool.submit_read(tier.load_batch, items[i : i + 16]) for i in range(0, n, 16)]
    assert all(all(f.result()) for f in futs)
    assert all(bytes(o) == b for o, b in zip(outs, blobs))
    tier.shutdown()
