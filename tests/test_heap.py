"""``tierstore.heap``: the C heap's free pages, scattered between live blocks, handed back to the
system (the process's anonymous memory falls), and a flush doing so."""

import subprocess
import sys

import pytest
import torch

from tierstore import TieredStore
from tierstore.heap import release_free_heap
from tierstore.tiers import stack

FRAGMENTED_HEAP = """
import ctypes
from tierstore.heap import release_free_heap
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def anonymous_kib():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1])
blocks = [libc.malloc(64 << 10) for _ in range(4096)]  # 256 MiB of blocks below the map threshold
for block in blocks:
    ctypes.memset(block, 1, 64 << 10)  # touched: resident
for number, block in enumerate(blocks):
    if number % 64:  # one block in 64 stays live: the free space lies between live blocks
        libc.free(block)
before = anonymous_kib()
assert release_free_heap()
print(before, anonymous_kib())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap and /proc are Linux's")
def test_free_pages_between_live_blocks_go_back_to_the_system():
    """256 MiB of heap blocks, all but one in 64 freed: the free space cannot be trimmed from the
    heap's top, and stays resident until ``release_free_heap``, which gives most of it back."""
    if not release_free_heap():
        pytest.skip("this C library has no malloc_trim (not glibc)")
    run = subprocess.run([sys.executable, "-c", FRAGMENTED_HEAP], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    before, after = map(int, run.stdout.split())
    assert before - after > 200 << 10, (before, after)  # KiB: most of the 252 MiB freed


def test_a_flush_releases_the_free_heap_before_and_after(tmp_path, monkeypatch):
    """A flush hands the free heap back before it stages and reads (its page cache under a limit)
    and after, and commits the rows as ever."""
    calls = []
    monkeypatch.setattr(stack, "release_free_heap", lambda: calls.append(True))
    store = TieredStore(tmp_path / "s", dim=2, host_cache=8)
    keys = torch.arange(20)
    store.put(keys, torch.ones(20, 2))
    store.flush()
    assert len(calls) == 2
    store.close()
    with TieredStore(tmp_path / "s", read_only=True) as reader:
        assert torch.equal(reader.get(keys), torch.ones(20, 2))
