"""A tier's host arrays are asked for on 2 MiB pages (``tiers.huge_pages``): the same values as
torch's, and the kernel told so (``THPeligible`` of their mapping in /proc/self/smaps)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tierstore.tiers import huge_pages

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mode() -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), None if unknown."""
    try:
        return THP_MODE.read_text().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def test_the_arrays_hold_what_torch_would():
    assert torch.equal(
        huge_pages.full((3 << 20,), -1, torch.int64, torch.device("cpu")), torch.full((3 << 20,), -1)
    )
    small = huge_pages.full((5,), 7, torch.uint8, torch.device("cpu"))  # under a huge page: plain
    assert small.dtype == torch.uint8 and small.tolist() == [7] * 5
    assert huge_pages.empty((4, 6), torch.float32, torch.device("cpu")).shape == (4, 6)
    for dtype in (torch.bool, torch.uint8, torch.bfloat16, torch.int32):  # each tier array's kind
        rows = huge_pages.full((1 << 20, 3), 1, dtype, "cpu")
        assert rows.dtype == dtype and rows.shape == (1 << 20, 3) and bool((rows == 1).all())


def test_an_array_the_kernel_will_not_map_comes_from_torchs_allocator(monkeypatch):
    def refused(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(huge_pages.mmap, "mmap", refused)
    array = huge_pages.full((3 << 20,), 5, torch.int32, torch.device("cpu"))
    assert array.shape == (3 << 20,) and bool((array == 5).all())


ELIGIBILITY = """
import sys
from pathlib import Path
import torch
from tierstore import TieredEmbeddingBag


def eligible(tensor):  # whether the mapping holding the tensor's middle may take huge pages
    address, inside = tensor.data_ptr() + tensor.nbytes // 2, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ")[0] and not line.startswith(("THP", "Anon", "Swap")):
            start, end = (int(part, 16) for part in line.split(" ")[0].split("-"))
            inside = start <= address < end
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"


control = torch.empty(4 << 20, dtype=torch.uint8)  # asked for nothing
table = TieredEmbeddingBag(1_100_000, 16, host_cache=1_100_000)  # bounded: its tier whole at once
top = table.store.stack.top
print(eligible(top.rows), eligible(top.index.keys), eligible(top.policy.score), eligible(control))
"""


def test_a_tiers_rows_and_index_are_on_huge_page_mappings():
    """In a fresh process (a long one may hand a later array memory an earlier one marked)."""
    if _mode() not in ("madvise", "always") or not Path("/proc/self/smaps").exists():
        pytest.skip(f"transparent huge pages are {_mode() or 'unknown here'}: nothing to ask for")
    result = subprocess.run([sys.executable, "-c", ELIGIBILITY], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    rows, index, scores, control = result.stdout.split()
    assert (rows, index, scores) == ("True", "True", "True")
    assert control == ("True" if _mode() == "always" else "False")  # the tier's own asking made them so


RECYCLED = """
import ctypes
import mmap
import struct
import torch
from tierstore import TieredEmbeddingBag


def huge_share(tensor):  # of the tensor's whole 2 MiB pages in memory, the share on huge pages
    first = -(-tensor.data_ptr() // (2 << 20)) * (2 << 20) // 4096
    pages = (tensor.data_ptr() + tensor.nbytes) // (2 << 20) * (2 << 20) // 4096 - first
    with open("/proc/self/pagemap", "rb") as pagemap, open("/proc/kpageflags", "rb") as flags:
        pagemap.seek(first * 8)
        entries = struct.unpack(f"{pages}Q", pagemap.read(pages * 8))
        present = [entry & ((1 << 55) - 1) for entry in entries if entry >> 63]
        huge = 0
        for frame in present:
            flags.seek(frame * 8)
            huge += struct.unpack("Q", flags.read(8))[0] >> 22 & 1
    return huge / len(present)


# the control: what the kernel gives a fresh mapping marked for huge pages before its first touch
mapping = mmap.mmap(-1, 10 << 20, flags=mmap.MAP_PRIVATE)
control = torch.frombuffer(mapping, dtype=torch.uint8)
control = control[-control.data_ptr() % (2 << 20) :][: 8 << 20]
ctypes.CDLL(None).madvise(ctypes.c_void_p(control.data_ptr()), ctypes.c_size_t(8 << 20), 14)
control.fill_(1)
print(huge_share(control))
# the allocator's mapping threshold raised past the tier's arrays, and its heap touched on 4 KiB pages
for size in (30 << 20, 28 << 20):
    block = torch.ones(size, dtype=torch.uint8)
    del block
table = TieredEmbeddingBag(1_100_000, 16, host_cache=1_100_000)
table(torch.randint(0, 1_100_000, (200_000,)), torch.arange(0, 200_000, 20))  # rows in memory
top = table.store.stack.top
print(huge_share(top.rows), huge_share(top.index.keys), huge_share(top.index.values))
"""


def test_a_tier_built_where_the_allocator_recycles_touched_memory_is_on_huge_pages():
    """The pages themselves (``/proc/kpageflags``' THP bit, root only): arrays the allocator would
    carve from memory it touched before would get 4 KiB pages, marked or not."""
    if _mode() not in ("madvise", "always"):
        pytest.skip(f"transparent huge pages are {_mode() or 'unknown here'}: nothing to ask for")
    if not os.access("/proc/kpageflags", os.R_OK):
        pytest.skip("/proc/kpageflags is not readable here (it takes root): the pages cannot be seen")
    result = subprocess.run([sys.executable, "-c", RECYCLED], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    control, *shares = [float(share) for share in result.stdout.split()]
    if control < 0.9:
        pytest.skip(f"the kernel gave a fresh marked mapping {control:.0%} huge pages here: none to be had")
    assert all(share >= 0.9 for share in shares), shares  # a few may fall back where memory is short
