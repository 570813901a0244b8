"""Issue 13: a damaged or incomplete store is a ``StoreFormatError`` naming the file, never a
SIGBUS and never an empty table; the CLI reports it (verify exits 1, the others 2)."""

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from tierstore import StoreFormatError, TieredStore
from tierstore.tiers.cold import lmdb_opening

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


READ_AND_COMPARE = (
    "import sys, torch\nfrom tierstore import TieredStore, StoreFormatError\n"
    "try:\n"
    "    with TieredStore(sys.argv[1], read_only=True, host_cache=64) as store:\n"
    "        ids = torch.arange(3000)\n"
    "        rows = torch.cat([store.get(part) for part in ids.split(50)])\n"
    "    expected = torch.arange(3000 * 8, dtype=torch.float32).reshape(3000, 8)\n"
    "    print('correct' if torch.equal(rows, expected) else 'WRONG')\n"
    "except StoreFormatError as error:\n"
    "    print('StoreFormatError', error)\n"
)


def read_in_subprocess(path):
    result = subprocess.run(
        [sys.executable, "-c", READ_AND_COMPARE, str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr  # a signal would be negative
    return result.stdout.strip()


def pages_holding(data_file, needle, page_size=4096):
    data = data_file.read_bytes()
    return sorted({offset // page_size for offset in _occurrences(data, needle)} - {0, 1})  # not the metas


def _occurrences(data, needle):
    offset = data.find(needle)
    while offset >= 0:
        yield offset
        offset = data.find(needle, offset + 1)


@pytest.mark.parametrize("damage", ["node bytes", "whole page"])
def test_scribbled_lmdb_pages_are_format_errors_never_wrong_or_new_rows(tmp_path, damage):
    """Every page holding id 1234's key (its live leaf, and copies in freed pages) is overwritten
    with random bytes: reading the table must raise, not serve wrong rows or an initial row."""
    make_store(tmp_path / "s", "lmdb")
    data_file = tmp_path / "s" / "lmdb" / "data.mdb"
    pages = pages_holding(data_file, (1234).to_bytes(8, "big"))
    assert pages
    with open(data_file, "r+b") as file:
        for page in pages:
            start = page * 4096 + (16 if damage == "node bytes" else 0)  # keep or lose the page header
            file.seek(start)
            file.write(os.urandom((page + 1) * 4096 - start))
    outcome = read_in_subprocess(tmp_path / "s")
    assert outcome.startswith("StoreFormatError") and "data.mdb is damaged" in outcome, outcome


@pytest.mark.parametrize("mode", ["rw", "ro"])
def test_scribbled_lmdb_pages_that_killed_a_reader_are_a_format_error(tmp_path, mode):
    """The scribble above with the bytes of one seed that was a bus error before the pages were
    walked at open: an entry it left claims a value of 1.6 GB, and py-lmdb touches every page of a
    value it returns, past the file's end."""
    make_store(tmp_path / "s", "lmdb")
    data_file = tmp_path / "s" / "lmdb" / "data.mdb"
    pages = pages_holding(data_file, (1234).to_bytes(8, "big"))
    scribble = random.Random(260)
    with open(data_file, "r+b") as file:
        for page in pages:
            file.seek(page * 4096 + 16)
            file.write(scribble.randbytes(4096 - 16))
    result = subprocess.run(
        [sys.executable, "-c", OPEN_AND_READ, str(tmp_path / "s"), mode], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr  # a signal would be negative
    assert result.stdout.startswith("StoreFormatError") and "data.mdb is damaged" in result.stdout


def test_an_lmdb_store_as_its_writer_left_it_is_not_walked_again(tmp_path, monkeypatch):
    walked = []
    monkeypatch.setattr(lmdb_opening, "verify_pages", lambda path: walked.append(path) or [])
    make_store(tmp_path / "s", "lmdb")
    walked.clear()  # the new store's empty file was walked
    TieredStore(tmp_path / "s", read_only=True, host_cache=16).close()
    with TieredStore(tmp_path / "s", host_cache=16) as store:
        store.put(torch.tensor([5]), torch.ones(1, 8))
        store.flush()
    TieredStore(tmp_path / "s", read_only=True, host_cache=16).close()
    assert walked == []
    data_file = tmp_path / "s" / "lmdb" / "data.mdb"
    os.utime(data_file, ns=(data_file.stat().st_atime_ns, data_file.stat().st_mtime_ns + 1))  # touched
    TieredStore(tmp_path / "s", read_only=True, host_cache=16).close()
    assert len(walked) == 1


def test_a_damaged_lmdb_value_is_a_format_error(tmp_path):
    make_store(tmp_path / "s", "lmdb")
    data_file = tmp_path / "s" / "lmdb" / "data.mdb"
    data = bytearray(data_file.read_bytes())
    value = torch.arange(1234 * 8, 1235 * 8, dtype=torch.float32).numpy().tobytes()
    for offset in _occurrences(bytes(data), value):  # every copy of the row: one bit flipped
        data[offset + 5] ^= 0x10
    data_file.write_bytes(bytes(data))
    outcome = read_in_subprocess(tmp_path / "s")
    assert "fail their checksum (first id: 1234)" in outcome, outcome


def test_random_bytes_in_mmap_rows_are_a_format_error(tmp_path):
    make_store(tmp_path / "s", "mmap")
    with open(tmp_path / "s" / "rows.bin", "r+b") as file:
        file.seek(1000 * 36 + 7)  # a stored row is 8 float32 and a 4-byte check
        file.write(os.urandom(16))
    outcome = read_in_subprocess(tmp_path / "s")
    assert "rows.bin is damaged: 1 stored row(s) fail their checksum" in outcome, outcome


def test_a_lowered_mmap_row_count_is_refused_at_open(tmp_path):
    make_store(tmp_path / "s", "mmap")
    state_file = tmp_path / "s" / "state.json"
    state_file.write_text(json.dumps({**json.loads(state_file.read_text()), "rows": 2000}))
    for read_only in (True, False):
        with pytest.raises(StoreFormatError, match="keys.bin does not match"):
            TieredStore(tmp_path / "s", read_only=read_only)


def test_a_damaged_mmap_key_file_is_found_by_verify_and_refused_when_the_index_is_rebuilt(tmp_path):
    """Opening trusts the key index (``index.bin``) without reading ``keys.bin``: a key overwritten
    there misleads no lookup (every row reads right), ``structure_problems`` (``tierstore verify``)
    finds it, and so does rebuilding the index from it."""
    make_store(tmp_path / "s", "mmap")
    with open(tmp_path / "s" / "keys.bin", "r+b") as file:
        file.seek(8 * 700)
        file.write((999_999).to_bytes(8, "little"))
    assert read_in_subprocess(tmp_path / "s") == "correct"
    with TieredStore(tmp_path / "s", read_only=True, host_cache=64) as store:
        problems = store.structure_problems()
    assert len(problems) == 2 and "keys.bin does not match" in problems[0], problems
    assert "1 of its 3000 ids are not found at their row" in problems[1], problems
    (tmp_path / "s" / "index.bin").unlink()
    for read_only in (True, False):
        with pytest.raises(StoreFormatError, match="keys.bin does not match"):
            TieredStore(tmp_path / "s", read_only=read_only)


def test_stores_of_format_version_1_without_checksums_still_open_and_train(tmp_path):
    from tierstore.metadata import StoreMetadata, create_store
    from tierstore.tiers.cold import open_cold_store

    for backend in ("lmdb", "mmap"):
        path = tmp_path / backend
        create_store(
            path,
            StoreMetadata(
                backend=backend, dim=8, dtype="float32", optimizer_state_width=0, seed=0, format_version=1
            ),
        )
        open_cold_store(
            backend, path, 8, torch.float32, read_only=False, checksums=False
        ).close()  # as v1 made it
        make_store(path, backend)
        with TieredStore(path, host_cache=64) as store:
            assert store.metadata.format_version == 1 and not store.stack.cold.codec.check_bytes
            expected = torch.arange(3000 * 8, dtype=torch.float32).reshape(3000, 8)
            assert torch.equal(
                torch.cat([store.get(part) for part in torch.arange(3000).split(50)]), expected
            )
    assert (tmp_path / "mmap" / "rows.bin").stat().st_size >= 3000 * 32
    assert read_in_subprocess(tmp_path / "lmdb") == "correct"


def test_an_lmdb_key_overwritten_is_a_format_error_not_a_new_row(tmp_path):
    """The 8 key bytes of id 1234's entries become other bytes: the id is no longer found, and
    the entry left in its place fails its check as its neighbour."""
    make_store(tmp_path / "s", "lmdb")
    data_file = tmp_path / "s" / "lmdb" / "data.mdb"
    data = bytearray(data_file.read_bytes())
    for offset in list(_occurrences(bytes(data), (1234).to_bytes(8, "big"))):
        data[offset : offset + 8] = (1152).to_bytes(8, "big")  # an id held elsewhere, out of place here
    data_file.write_bytes(bytes(data))
    outcome = read_in_subprocess(tmp_path / "s")
    assert outcome.startswith("StoreFormatError") and "data.mdb is damaged" in outcome, outcome
