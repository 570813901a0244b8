"""The ``tierstore`` command line, through its entry point (in process) and as a console script."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch
from safetensors import safe_open

from tierstore import TieredStore
from tierstore.cli import main
from tierstore.errors import StoreFormatError
from tierstore.metadata import FORMAT_VERSION


def run(*args):
    return main([str(arg) for arg in args])


def stored_rows(path, ids, with_state=False):
    with TieredStore(path, read_only=True, host_cache=1024) as store:
        return store.get(torch.as_tensor(ids), with_state=with_state)


@pytest.fixture
def dense(tmp_path):
    rows = np.random.default_rng(0).standard_normal((700, 6)).astype(np.float32)
    np.save(tmp_path / "dense.npy", rows)
    return rows


@pytest.mark.parametrize("backend", ["mmap", "lmdb"])
@pytest.mark.parametrize("suffix", [".npy", ".pt", ".safetensors"])
def test_dense_round_trip_is_bit_exact(tmp_path, dense, backend, suffix):
    assert (
        run("import", tmp_path / "dense.npy", tmp_path / "a", "--backend", backend, "--chunk-rows", 128) == 0
    )
    assert torch.equal(stored_rows(tmp_path / "a", range(700)), torch.from_numpy(dense))
    assert run("export", tmp_path / "a", tmp_path / f"out{suffix}", "--chunk-rows", 100) == 0
    assert run("import", tmp_path / f"out{suffix}", tmp_path / "b", "--backend", backend) == 0
    assert run("export", tmp_path / "b", tmp_path / "back.npy") == 0
    assert np.load(tmp_path / "back.npy").tobytes() == dense.tobytes()


@pytest.mark.parametrize("suffix", [".npy", ".pt", ".safetensors"])
def test_sparse_round_trip_keeps_ids_and_optimizer_state(tmp_path, suffix):
    rng = np.random.default_rng(1)
    ids = rng.choice(10**12, 300, replace=False).astype(np.int64)
    rows = rng.standard_normal((300, 4)).astype(np.float16)
    np.save(tmp_path / "ids.npy", ids)
    np.save(tmp_path / "rows.npy", rows)
    assert (
        run(
            "import",
            tmp_path / "rows.npy",
            tmp_path / "a",
            "--ids",
            tmp_path / "ids.npy",
            "--optimizer",
            "adam",
        )
        == 0
    )
    whole = stored_rows(tmp_path / "a", ids, with_state=True)
    # float16 rows hold Adam's 8 state values in float32: 16 values after the 4 weights
    assert whole.shape == (300, 20) and bool((whole[:, 4:] == 0).all())  # Adam's m and v start at 0
    assert torch.equal(whole[:, :4], torch.from_numpy(rows))
    with TieredStore(tmp_path / "a", host_cache=1024) as store:  # give the state values to export
        store.put(torch.from_numpy(ids[:5]), torch.arange(100, dtype=torch.float16).reshape(5, 20))
    extra = ["--ids", tmp_path / "out_ids.npy"] if suffix == ".npy" else []
    assert run("export", tmp_path / "a", tmp_path / f"out{suffix}", "--with-state", *extra) == 0
    reimport = ["--ids", tmp_path / "out_ids.npy"] if suffix == ".npy" else []
    assert run("import", tmp_path / f"out{suffix}", tmp_path / "b", *reimport) == 0  # state as weights now
    assert torch.equal(stored_rows(tmp_path / "b", ids), stored_rows(tmp_path / "a", ids, with_state=True))


def test_safetensors_export_reads_back_with_the_safetensors_library(tmp_path, dense):
    run("import", tmp_path / "dense.npy", tmp_path / "a")
    run("export", tmp_path / "a", tmp_path / "out.safetensors")
    with safe_open(str(tmp_path / "out.safetensors"), framework="np") as file:
        assert list(file.keys()) == ["weight"] and np.array_equal(file.get_tensor("weight"), dense)


def test_checkpoint_import_picks_the_embedding_weight_or_asks_for_a_key(tmp_path, capsys):
    weight = torch.randn(50, 3)
    torch.save(
        {"emb.weight": weight, "mlp.weight": torch.randn(4, 4), "bias": torch.ones(4)}, tmp_path / "model.pt"
    )
    assert run("import", tmp_path / "model.pt", tmp_path / "a") == 2
    assert "choose the table with --key, one of: emb.weight, mlp.weight" in capsys.readouterr().err
    assert run("import", tmp_path / "model.pt", tmp_path / "a", "--key", "emb.weight") == 0
    assert torch.equal(stored_rows(tmp_path / "a", range(50)), weight)
    torch.save(torch.nn.EmbeddingBag(20, 5).state_dict(), tmp_path / "bag.pt")
    assert run("import", tmp_path / "bag.pt", tmp_path / "b") == 0


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: None, "no such file"),
        (lambda d: (d / "src.csv").write_text("1,2"), "unknown format '.csv'"),
        (lambda d: np.save(d / "src.npy", np.ones(5, np.float32)), "rows must be a 2-D float array"),
        (lambda d: np.save(d / "src.npy", np.ones((5, 2), np.int64)), "rows must be a 2-D float array"),
        (lambda d: (d / "src.npy").write_bytes(b"not numpy"), "not a readable .npy file"),
        (lambda d: (d / "src.pt").write_bytes(b"not torch"), "not a readable PyTorch checkpoint"),
        (lambda d: (d / "src.safetensors").write_bytes(b"\x00" * 16), "not a readable safetensors file"),
    ],
)
def test_bad_sources_fail_with_one_line_and_exit_2(tmp_path, capsys, make, message):
    make(tmp_path)
    source = next(iter(sorted(tmp_path.glob("src.*"))), tmp_path / "src.npy")
    assert run("import", source, tmp_path / "store") == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize(
    "ids, message",
    [
        (np.arange(4), "4 ids for 5 rows"),
        (np.array([0, 1, 2, 3, -4]), "non-negative"),
        (np.array([0, 1, 2, 2, 3]), "ids repeat"),
        (np.ones(5, np.float32), "1-D integer array"),
    ],
)
def test_bad_ids_files_are_refused(tmp_path, capsys, ids, message):
    np.save(tmp_path / "rows.npy", np.ones((5, 2), np.float32))
    np.save(tmp_path / "ids.npy", ids)
    assert run("import", tmp_path / "rows.npy", tmp_path / "store", "--ids", tmp_path / "ids.npy") == 2
    assert message in capsys.readouterr().err


def test_import_refuses_an_existing_store_and_changes_nothing(tmp_path, dense, capsys):
    run("import", tmp_path / "dense.npy", tmp_path / "a")
    before = stored_rows(tmp_path / "a", range(700))
    np.save(tmp_path / "other.npy", np.zeros((3, 6), np.float32))
    assert run("import", tmp_path / "other.npy", tmp_path / "a") == 2
    assert "exists" in capsys.readouterr().err
    assert torch.equal(stored_rows(tmp_path / "a", range(700)), before)


@pytest.mark.parametrize("suffix", [".npy", ".pt"])
def test_an_export_that_fills_the_disk_fails_with_one_line_and_leaves_no_file(
    tmp_path, tiny_filesystem, suffix
):
    """100,000 rows of 8 floats do not fit a 2 MiB filesystem: the export exits 2 naming ENOSPC and
    leaves nothing there (it died of SIGBUS, writing through a memory map, and left a partial file)."""
    with TieredStore(tmp_path / "store", dim=8, host_cache=1000) as store:
        store.put(torch.arange(100_000), torch.rand(100_000, 8))
    target = tiny_filesystem / f"out{suffix}"
    result = subprocess.run(
        [*CLI, "export", str(tmp_path / "store"), str(target)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "No space left on device" in result.stderr
    assert list(tiny_filesystem.iterdir()) == []


def test_import_killed_midway_leaves_no_store(tmp_path):
    rows = np.lib.format.open_memmap(tmp_path / "big.npy", mode="w+", dtype=np.float32, shape=(400_000, 64))
    rows[:] = 1.0
    rows.flush()
    importer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tierstore",
            "import",
            str(tmp_path / "big.npy"),
            str(tmp_path / "store"),
            "--chunk-rows",
            "500",
        ],
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    building = []
    while not building and time.monotonic() < deadline:  # kill once the store is being built
        building = [
            p
            for p in tmp_path.glob(".store.importing-*")
            if (p / "rows.bin").exists() and (p / "rows.bin").stat().st_size > 0
        ]  # rows being written
        time.sleep(0.01)
    assert building, "the import never started building"
    importer.send_signal(signal.SIGKILL)  # 800 chunks of 500 rows: far from done
    importer.wait()
    assert importer.returncode == -signal.SIGKILL, "the import finished before it was killed; make it bigger"
    assert not (tmp_path / "store").exists(), "the import completed before the kill; make it bigger"
    with pytest.raises(StoreFormatError, match="not a tierstore store"):
        TieredStore(building[0], read_only=True)


def test_inspect_reports_the_layout_as_a_table_and_as_json(tmp_path, dense, capsys):
    run("import", tmp_path / "dense.npy", tmp_path / "a", "--optimizer", "rowwise_adagrad")  # either spelling
    capsys.readouterr()
    assert run("inspect", tmp_path / "a", "--json") == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["rows"] == 700 and facts["dim"] == 6 and facts["dtype"] == "float32"
    assert facts["optimizer"] == "rowwise-adagrad" and facts["optimizer_state_width"] == 1
    assert (
        facts["format_version"] == FORMAT_VERSION
        and facts["row_bytes"] == 28
        and facts["size_on_disk_bytes"] >= 700 * 28
    )
    assert facts["last_flush_utc"].startswith("20")
    assert run("inspect", tmp_path / "a") == 0
    table = capsys.readouterr().out
    assert "rows" in table and "700" in table and "rowwise-adagrad" in table


@pytest.mark.parametrize("backend", ["mmap", "lmdb"])
def test_verify_passes_a_sound_store(tmp_path, dense, backend, capsys):
    run("import", tmp_path / "dense.npy", tmp_path / "a", "--backend", backend)
    assert run("verify", tmp_path / "a") == 0
    assert "sound" in capsys.readouterr().out


def _nan_row(store):
    with TieredStore(store) as opened:
        opened.put([5], torch.full((1, 6), float("nan")), allow_nonfinite=True)


def _random_bytes_in_rows(store):
    with open(store / "rows.bin", "r+b") as file:
        file.seek(5 * 28 + 3)
        file.write(bytes([0x5A]) * 8)


def _random_bytes_in_lmdb_values(store):
    env = lmdb.open(str(store / "lmdb"), max_dbs=2)
    with env.begin(write=True) as txn:
        rows = env.open_db(b"rows", txn=txn)
        key = (9).to_bytes(8, "big")
        value = bytearray(txn.get(key, db=rows))
        value[2] ^= 0xFF
        txn.put(key, bytes(value), db=rows)
    env.close()


def _truncated_rows(store):
    os.truncate(store / "rows.bin", 100)


def _bad_metadata(store):
    (store / "tierstore.json").write_text("{ not json")


def _wrong_length_lmdb_value(store):
    env = lmdb.open(str(store / "lmdb"), max_dbs=2)
    with env.begin(write=True) as txn:
        txn.put((7).to_bytes(8, "big"), b"short", db=env.open_db(b"rows", txn=txn))
    env.close()


@pytest.mark.parametrize(
    "backend, damage, message",
    [
        ("mmap", _nan_row, "non-finite values (first id: 5)"),
        ("lmdb", _nan_row, "non-finite values (first id: 5)"),
        ("mmap", _random_bytes_in_rows, "fail their checksum (first id: 5)"),
        ("lmdb", _random_bytes_in_lmdb_values, "fail their checksum (first id: 9)"),
        ("mmap", _truncated_rows, "truncated"),
        ("mmap", _bad_metadata, "tierstore.json"),
        ("lmdb", _wrong_length_lmdb_value, "5-byte value"),
    ],
)
def test_verify_finds_a_damaged_store_and_exits_1(tmp_path, dense, capsys, backend, damage, message):
    run("import", tmp_path / "dense.npy", tmp_path / "a", "--backend", backend)
    damage(tmp_path / "a")
    capsys.readouterr()
    assert run("verify", tmp_path / "a") == 1
    assert message in capsys.readouterr().out


CLI = [sys.executable, "-m", "tierstore"]  # the environment's own interpreter, whatever PATH holds
COMMANDS = ("import", "export", "apply-delta", "inspect", "verify", "compact", "bench", "profile")


def test_every_command_has_help_through_the_console_script(capsys):
    """Both entry points (the console script pip installs, ``python -m tierstore``) run, and every
    command answers ``--help`` (in this process: each start of a process costs seconds)."""
    script = Path(sys.executable).parent / "tierstore"  # where pip puts it, beside the interpreter
    assert script.exists(), f"pip install should have put the tierstore console script at {script}"
    for cli in ([str(script)], CLI):
        result = subprocess.run([*cli, "--help"], capture_output=True, text=True)
        assert result.returncode == 0 and "usage: tierstore" in result.stdout
        assert all(command in result.stdout for command in COMMANDS)
    for command in COMMANDS:
        with pytest.raises(SystemExit) as exit_:
            main([command, "--help"])
        assert exit_.value.code == 0 and f"usage: tierstore {command}" in capsys.readouterr().out


def test_unknown_store_and_usage_errors_exit_2():
    result = subprocess.run([*CLI, "inspect", "/nonexistent/store"], capture_output=True, text=True)
    assert (
        result.returncode == 2
        and "no such store directory" in result.stderr
        and "Traceback" not in result.stderr
    )
    assert subprocess.run([*CLI, "frobnicate"], capture_output=True).returncode == 2


# -- every option checked before any work (issue 13) ------------------------------------------------


@pytest.mark.parametrize("chunk_rows", ["-5", "0", "ten"])
def test_chunk_rows_must_be_a_positive_whole_number(tmp_path, dense, chunk_rows, capsys):
    with pytest.raises(SystemExit) as exit_:
        run("import", tmp_path / "dense.npy", tmp_path / "a", "--chunk-rows", chunk_rows)
    assert exit_.value.code == 2 and "--chunk-rows" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()
    assert run("import", tmp_path / "dense.npy", tmp_path / "a") == 0
    with pytest.raises(SystemExit) as exit_:
        run("export", tmp_path / "a", tmp_path / "out.npy", "--chunk-rows", chunk_rows)
    assert exit_.value.code == 2 and not (tmp_path / "out.npy").exists()


def test_ids_past_int64_are_named_not_a_traceback(tmp_path, dense, capsys):
    np.save(tmp_path / "ids.npy", np.arange(700, dtype=np.uint64) + np.uint64(2**63 - 3))
    assert run("import", tmp_path / "dense.npy", tmp_path / "a", "--ids", tmp_path / "ids.npy") == 2
    assert "ids must be below 2**63 (int64), found 9223372036854775808" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()
    np.save(tmp_path / "ids.npy", np.arange(700, dtype=np.uint64) * np.uint64(3))  # uint64 that fit: fine
    assert run("import", tmp_path / "dense.npy", tmp_path / "a", "--ids", tmp_path / "ids.npy") == 0
    assert torch.equal(stored_rows(tmp_path / "a", [3 * 699]), torch.from_numpy(dense[699:]))


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["zipf:n=1000", "--sizes", ","], "--sizes ',' names no size"),
        (["zipf:n=1000", "--sizes", "5%,lots"], "cache size 'lots' does not parse"),
        (
            ["zipf:n=1000", "--sizes", "1%,0.05"],
            "cache size '0.05' has no unit: give a share of distinct ids with a % (5%)",
        ),
        (
            ["zipf:n=1000", "--sizes", "0"],
            "cache size '0' holds no rows (64 bytes a row)",
        ),  # no made-up count
        (["zipf:n=1000", "--out", "/proc/no/such/dir/x"], "cannot write /proc/no/such/dir/x.json"),
        (["drift:n=100,hot=0"], "drift: hot must be a whole number from 1"),
        (["uniform:n=1e30"], "uniform: n must be a whole number from 1"),
        (["zipf:n=100,alpha=-1"], "zipf: alpha must be above 0"),
    ],
)
def test_bench_options_are_checked_before_the_run(tmp_path, monkeypatch, capsys, arguments, message):
    import tierstore.analysis.hit_rates as hit_rates

    monkeypatch.setattr(
        hit_rates, "run_store", lambda *args: pytest.fail("the replay ran despite a bad option")
    )
    assert run("bench", *arguments) == 2
    error = capsys.readouterr().err
    assert message in error and "Traceback" not in error


def _stderr_of(command: list[str], terminal: bool) -> str:
    """What ``command`` writes to stderr when stderr is a pipe, or a terminal (a pseudo-terminal)."""
    if not terminal:
        return subprocess.run(command, capture_output=True, text=True, check=True).stderr
    import fcntl
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))  # a terminal's size
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=follower)
    os.close(follower)
    written = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the terminal closed when the process ended
            break
        if not chunk:
            break
        written += chunk
    assert process.wait() == 0
    os.close(leader)
    return written.decode(errors="replace")


def test_progress_bars_show_on_a_terminal_only_and_quiet_silences_them(tmp_path, dense):
    def importing(name, *flags):
        return [
            *CLI,
            "import",
            str(tmp_path / "dense.npy"),
            str(tmp_path / name),
            "--chunk-rows",
            "100",
            *flags,
        ]

    assert "importing dense.npy" in _stderr_of(importing("a"), terminal=True)
    assert _stderr_of(importing("b"), terminal=False) == ""  # a log or a pipe: no bar
    assert "importing" not in _stderr_of(importing("c", "--quiet"), terminal=True)


def test_import_and_export_convert_the_rows_dtype(tmp_path, dense):
    rows = torch.from_numpy(dense)
    assert (
        run(
            "import",
            tmp_path / "dense.npy",
            tmp_path / "half",
            "--dtype",
            "float16",
            "--optimizer",
            "adagrad",
        )
        == 0
    )
    with TieredStore(tmp_path / "half", read_only=True, host_cache=1024) as store:
        assert store.dtype == torch.float16 and store.metadata.state_dtype == "float32"
        assert torch.equal(store.get(torch.arange(rows.shape[0])), rows.to(torch.float16))
    assert run("export", tmp_path / "half", tmp_path / "wide.pt", "--dtype", "float32") == 0
    assert torch.equal(torch.load(tmp_path / "wide.pt")["weight"], rows.to(torch.float16).float())


def test_a_conversion_that_would_lose_a_row_is_refused_before_anything_is_written(tmp_path, capsys):
    rows = np.ones((6, 3), dtype=np.float32)
    rows[4, 1] = 1e6  # past float16's 65504
    np.save(tmp_path / "rows.npy", rows)
    assert run("import", tmp_path / "rows.npy", tmp_path / "half", "--dtype", "float16") == 2
    assert "id 4's row holds 1e+06, past what torch.float16 holds" in capsys.readouterr().err
    assert not (tmp_path / "half").exists() and not list(tmp_path.glob(".half*"))  # no store, no leftovers
    assert run("import", tmp_path / "rows.npy", tmp_path / "wide") == 0
    assert run("export", tmp_path / "wide", tmp_path / "half.npy", "--dtype", "float16") == 2
    assert "id 4's row holds 1e+06" in capsys.readouterr().err
    assert not (tmp_path / "half.npy").exists()


def test_whole_rows_are_exported_in_the_stores_dtype_only(tmp_path, dense, capsys):
    assert run("import", tmp_path / "dense.npy", tmp_path / "a", "--optimizer", "adagrad") == 0
    assert run("export", tmp_path / "a", tmp_path / "b.pt", "--with-state", "--dtype", "float16") == 2
    assert "laid out for torch.float32" in capsys.readouterr().err
    assert not (tmp_path / "b.pt").exists()
    assert (
        run("import", tmp_path / "dense.npy", tmp_path / "c", "--dtype", "float16") == 0
    )  # no state: nothing to lay out
    assert run("export", tmp_path / "c", tmp_path / "c.pt", "--with-state", "--dtype", "float32") == 0
