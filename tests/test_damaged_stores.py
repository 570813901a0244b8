"""Issue 13: a damaged or incomplete store is a ``StoreFormatError`` naming the file, never a
SIGBUS and never an empty table; the CLI reports it (verify exits 1, the others 2)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tierstore import StoreFormatError, TieredStore

CLI = [sys.executable, "-m", "tierstore"]


def make_store(path, backend, rows=3000, dim=8):
    with TieredStore(path, dim=dim, backend=backend, host_cache=rows) as store:
        store.put(torch.arange(rows), torch.arange(rows * dim, dtype=torch.float32).reshape(rows, dim))


OPEN_AND_READ = (
    "import sys, torch\nfrom tierstore import TieredStore, StoreFormatError\n"
    "try:\n"
    "    with TieredStore(sys.argv[1], read_only=sys.argv[2] == 'ro', host_cache=4000) as store:\n"
    "        store.get(torch.arange(3000))\n"
    "    print('opened')\n"
    "except StoreFormatError as error:\n"
    "    print('StoreFormatError', error)\n"
)


@pytest.mark.parametrize("mode", ["rw", "ro"])
def test_a_truncated_lmdb_file_is_a_format_error_not_sigbus(tmp_path, mode):
    make_store(tmp_path / "s", "lmdb")
    data = tmp_path / "s" / "lmdb" / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)
    result = subprocess.run(
        [sys.executable, "-c", OPEN_AND_READ, str(tmp_path / "s"), mode], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr  # SIGBUS would be -7
    assert result.stdout.startswith("StoreFormatError") and "data.mdb is truncated" in result.stdout


def test_the_cli_reports_a_truncated_lmdb_file(tmp_path):
    make_store(tmp_path / "s", "lmdb")
    data = tmp_path / "s" / "lmdb" / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)
    for command, code in ((["verify"], 1), (["inspect"], 2), (["export", "--quiet"], 2)):
        arguments = [
            *CLI,
            command[0],
            str(tmp_path / "s"),
            *([str(tmp_path / "out.npy")] if command[0] == "export" else []),
        ]
        result = subprocess.run([*arguments, *command[1:]], capture_output=True, text=True)
        assert result.returncode == code, (command, result.returncode, result.stderr)
        assert "data.mdb is truncated" in result.stdout + result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "backend, missing",
    [
        ("lmdb", "lmdb/data.mdb"),
        ("lmdb", "lmdb"),
        ("mmap", "state.json"),
        ("mmap", "rows.bin"),
        ("mmap", "keys.bin"),
    ],
)
def test_a_missing_data_file_is_an_error_never_an_empty_table(tmp_path, backend, missing):
    make_store(tmp_path / "s", backend)
    target = tmp_path / "s" / missing
    if target.is_dir():
        for child in target.iterdir():
            child.unlink()
        target.rmdir()
    else:
        target.unlink()
    for read_only in (False, True):
        with pytest.raises(StoreFormatError, match="missing"):
            TieredStore(tmp_path / "s", read_only=read_only, host_cache=16)
    assert not (tmp_path / "s" / missing).exists()  # nothing was recreated


def test_metadata_edited_to_another_row_size_is_refused(tmp_path):
    make_store(tmp_path / "s", "mmap", dim=8)
    metadata_file = tmp_path / "s" / "tierstore.json"
    metadata = json.loads(metadata_file.read_text())
    metadata["dim"] = 4  # rows.bin holds rows of 8 values: read as 4 they would be garbage
    metadata_file.write_text(json.dumps(metadata))
    with pytest.raises(StoreFormatError, match="state.json says its rows are 32 bytes but .* says 16"):
        TieredStore(tmp_path / "s", host_cache=16)
