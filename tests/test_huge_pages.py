"""A tier's host arrays are asked for on 2 MiB pages (``tiers.huge_pages``): the same values as
torch's, and the kernel told so (``THPeligible`` of their mapping in /proc/self/smaps)."""

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
