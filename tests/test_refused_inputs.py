"""The catalogue of refused inputs (issue 29): each input below was once accepted silently, or ended
in a raw traceback or a signal. Each now gets a clear error naming the argument and the fix, or
the behaviour a user expects, and a refused call changes nothing: the store's rows, row count and
files are as they were (``unchanged``). Sections: silent results and lost rows, signals (in a
subprocess), unclear errors, and the command line."""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest
import torch

import tierstore
from tierstore import (
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    StoreBusyError,
    StoreFormatError,
    TieredEmbeddingBag,
    TieredEmbeddingBagCollection,
    TieredStore,
    admission_filter,
)
from tierstore.cli import main

LOCK_FILES = {"lock", "readers.lock", "lock.mdb"}  # flock targets and LMDB's reader table: no data


def files_of(path: Path) -> dict[str, str]:
    """Every data file under ``path`` (relative name -> SHA-256 of its bytes)."""
    return {
        str(file.relative_to(path)): hashlib.sha256(file.read_bytes()).hexdigest()
        for file in sorted(Path(path).rglob("*"))
        if file.is_file() and file.name not in LOCK_FILES
    }


def collection_state(collection: TieredEmbeddingBagCollection) -> list:
    """Every group's ``(row count, every row held)``, read without changing the stores."""
    state = []
    for group in collection.groups.values():
        keys = torch.cat([keys for keys, _ in group.store.iter_rows()] or [torch.zeros(0, dtype=torch.int64)])
        state.append((len(group.store), keys.sort().values, group.store.get(keys.sort().values, grow=False)))
    return state


def assert_same_state(before: list, after: list) -> None:
    assert len(before) == len(after)
    for (count, keys, rows), (count_after, keys_after, rows_after) in zip(before, after):
        assert count == count_after and torch.equal(keys, keys_after) and torch.equal(rows, rows_after)


TABLES = [
    EmbeddingBagConfig(None, 4, "items", ["item"]),
    EmbeddingBagConfig(100, 4, "users", ["user"]),
    EmbeddingBagConfig(50, 8, "ads", ["ad"]),
]


def kjt(keys, values, lengths):
    return KeyedJaggedTensor(keys, torch.tensor(values), lengths=torch.tensor(lengths))


@pytest.fixture
def collection(tmp_path):
    """A collection on disk holding a few rows in each group, flushed."""
    with closing(TieredEmbeddingBagCollection(TABLES, path=tmp_path / "c", host_cache=64)) as made:
        made(kjt(["item", "user", "ad"], [1, 2, 3, 4, 5, 6], [1, 1, 1, 1, 1, 1])).values().sum().backward()
        made.flush()
        yield made


def refused_and_unchanged(collection, root, call, error, message):
    """``call()`` raises ``error`` matching ``message``, and neither the collection's rows nor its
    files change."""
    before, files = collection_state(collection), files_of(root)
    with pytest.raises(error, match=message):
        call()
    assert_same_state(before, collection_state(collection))
    assert files_of(root) == files


# -- silent: wrong results or lost rows ------------------------------------------------------------


def test_a_collection_table_past_the_key_space_is_refused_where_it_is_declared(tmp_path):
    for num_embeddings in (2**47 + 1, 2**48, 2**62):
        tables = [EmbeddingBagConfig(num_embeddings, 4, "wide", ["w"]), TABLES[1]]
        with pytest.raises(ValueError, match=r"'wide': num_embeddings=\d+ is past .* below 2\*\*47"):
            TieredEmbeddingBagCollection(tables, path=tmp_path / "c", host_cache=64)
        assert not (tmp_path / "c").exists()
    edge = TieredEmbeddingBagCollection([EmbeddingBagConfig(2**47, 4, "edge", ["e"])], host_cache=64)
    assert edge(kjt(["e"], [2**47 - 1], [1])).values().shape == (1, 4)  # the last id of the space


@pytest.mark.parametrize("feature, table, bound", [("item", "items", 2**47), ("user", "users", 100)])
def test_ids_past_a_tables_key_space_are_refused_with_the_limit(collection, tmp_path, feature, table, bound):
    refused_and_unchanged(
        collection,
        tmp_path / "c",
        lambda: collection(kjt([feature], [1, bound], [2])),
        IndexError,
        rf"table '{table}': ids must be in \[0, {bound}\), got {bound}",
    )


@pytest.mark.parametrize(
    "features, error, message",
    [
        (kjt(["item", "user"], [True, False], [1, 1]), TypeError, "values must be a 1-D integer tensor"),
        (
            KeyedJaggedTensor(["item", "user"], torch.tensor([1 + 0j, 2 + 0j]), lengths=torch.tensor([1, 1])),
            TypeError,
            "values must be a 1-D integer tensor",
        ),
        (  # offsets [1, 2, 3]: lengths [1, 1] sum to the 2 values, but the bags do not start at 0
            KeyedJaggedTensor(["item", "user"], torch.tensor([1, 2]), offsets=torch.tensor([1, 2, 3])),
            ValueError,
            "offsets must start at 0",
        ),
        (
            KeyedJaggedTensor(["item"], torch.tensor([1, 2]), offsets=torch.tensor([0, 2, 1])),
            ValueError,
            "offsets must start at 0 and end at the number of values",
        ),
        (
            KeyedJaggedTensor(["item"], torch.tensor([1, 2, 3]), offsets=torch.tensor([0, 2, 1, 3])),
            ValueError,
            "offsets must be non-decreasing",
        ),
        (kjt(["item"], [1, 2], [True, True]), TypeError, "lengths must be a 1-D integer tensor"),
    ],
)
def test_bad_keyed_jagged_tensors_are_refused(collection, tmp_path, features, error, message):
    refused_and_unchanged(collection, tmp_path / "c", lambda: collection(features), error, message)


def test_a_torchrec_style_input_with_offsets_not_starting_at_zero_is_refused(collection, tmp_path):
    class TorchRecLike:  # TorchRec's KeyedJaggedTensor: lengths() derived from offsets, kept apart
        def keys(self):
            return ["item", "user"]

        def values(self):
            return torch.tensor([1, 2])

        def offsets_or_none(self):
            return torch.tensor([1, 2, 3])

        def lengths(self):
            return torch.tensor([1, 1])

    refused_and_unchanged(
        collection, tmp_path / "c", lambda: collection(TorchRecLike()), ValueError, "offsets must start at 0"
    )


def test_a_feature_name_given_as_a_string_is_refused_not_split_into_letters(tmp_path):
    with pytest.raises(
        TypeError, match=r"feature_names must be a list of str, got the str 'user'.*\['user'\]"
    ):
        TieredEmbeddingBagCollection(
            [EmbeddingBagConfig(10, 4, "users", "user")], path=tmp_path / "c", host_cache=64
        )
    assert not (tmp_path / "c").exists()
    with pytest.raises(TypeError, match="keys must be a list of feature names"):
        KeyedJaggedTensor("user", torch.tensor([1]), lengths=torch.tensor([1]))


@pytest.mark.parametrize(
    "bad_ids",
    [lambda batch: None, lambda batch: ["a", "b"], lambda batch: batch.float()],
    ids=["None", "strings", "floats"],
)
def test_prefetch_refuses_ids_that_are_not_ids_at_their_batch(tmp_path, bad_ids):
    batches = [torch.tensor([index, index + 1]) for index in range(5)]
    with closing(TieredEmbeddingBag(None, 4, path=tmp_path / "t", host_cache=64)) as table:
        seen = []
        with pytest.raises(TypeError, match=r"prefetch: batch 2: ids\(batch\) is .*pass ids="):
            for batch in tierstore.prefetch(
                batches,
                table,
                lookahead=1,
                ids=lambda b: bad_ids(b) if int(b[0]) == 2 else b,
                background=True,
            ):
                seen.append(int(batch[0]))
        assert seen == [0, 1]
        assert table.store.stack.top.pinned_count() == 0


def test_an_admission_threshold_no_counter_can_reach_is_refused():
    assert admission_filter(255).threshold == 255
    for bad in (256, 1000):
        with pytest.raises(ValueError, match=r"threshold must be an int in \[1, 255\].*never admit"):
            admission_filter(bad)
    with pytest.raises(AttributeError):
        tierstore.tiers.admission.AdmissionFilter256  # noqa: B018 (an unpickled name is refused too)


# -- unclear errors: now named, with the fix ----------------------------------------------------------


def test_a_dict_given_to_a_collection_is_refused_naming_keyed_jagged_tensor(collection, tmp_path):
    refused_and_unchanged(
        collection,
        tmp_path / "c",
        lambda: collection({"item": torch.tensor([1])}),
        TypeError,
        "features must be a KeyedJaggedTensor .* got dict; build one with",
    )


def test_an_empty_batch_gives_empty_pooled_embeddings(collection):
    def empty(keys):
        nothing = torch.zeros(0, dtype=torch.int64)
        return KeyedJaggedTensor(keys, nothing, lengths=nothing)

    out = collection(empty(["item", "ad"]))
    assert out.values().shape == (0, 12) and out["ad"].shape == (0, 8)
    out.values().sum().backward()
    assert collection(empty([])).values().shape == (0, 0)


def test_one_config_not_in_a_list_is_refused_with_the_fix():
    with pytest.raises(TypeError, match=r"tables must be a list of EmbeddingBagConfig.*wrap .* \[config\]"):
        TieredEmbeddingBagCollection(TABLES[0], host_cache=64)


def test_prefetch_of_something_that_is_not_batches_is_refused():
    with closing(TieredEmbeddingBag(None, 4, host_cache=64)) as table:
        with pytest.raises(TypeError, match="batches must be an iterable of batches .* got int"):
            tierstore.prefetch(5, table)


@pytest.mark.parametrize(
    "make",
    [
        lambda path: TieredStore(path, dim=4, tiers={}),
        lambda path: TieredEmbeddingBag(None, 4, path=path, tiers={"host_cache": 64}),
        lambda path: TieredEmbeddingBagCollection(TABLES, path=path, tiers={}),
    ],
)
def test_tiers_given_as_a_dict_is_refused_naming_tier_config(tmp_path, make):
    with pytest.raises(TypeError, match=r"tiers must be a tierstore.TierConfig or None, got dict.*keywords"):
        make(tmp_path / "s")
    assert not (tmp_path / "s").exists()


def test_a_bytes_path_is_a_path_as_open_takes_it(tmp_path):
    with TieredStore(os.fsencode(tmp_path / "s"), dim=4, host_cache=8) as store:
        store.put([3], torch.ones(1, 4))
    with TieredStore(tmp_path / "s", host_cache=8) as store:
        assert torch.equal(store.get([3]), torch.ones(1, 4))
    with closing(TieredEmbeddingBagCollection(TABLES, path=os.fsencode(tmp_path / "c"), host_cache=64)):
        pass
    assert (tmp_path / "c" / "collection.json").exists()
    with pytest.raises(TypeError, match="path must be a directory path .* got int 7"):
        TieredStore(7, dim=4, host_cache=8)


def test_a_sharded_tables_directory_opened_as_one_store_names_process_group(tmp_path):
    (tmp_path / "t" / "rank0-of-2").mkdir(parents=True)
    (tmp_path / "t" / "rank1-of-2").mkdir()
    files = files_of(tmp_path / "t")
    for make in (
        lambda: TieredStore(tmp_path / "t", dim=4, host_cache=8),
        lambda: TieredEmbeddingBag(None, 4, path=tmp_path / "t", host_cache=8),
    ):
        with pytest.raises(
            StoreFormatError, match="sharded over 2 ranks .* process_group= a group of 2 ranks"
        ):
            make()
    assert files_of(tmp_path / "t") == files and sorted(os.listdir(tmp_path / "t")) == [
        "rank0-of-2",
        "rank1-of-2",
    ]


def test_an_lmdb_reader_in_the_writers_own_process_is_refused_with_the_way_out(tmp_path):
    with TieredStore(tmp_path / "s", dim=4, backend="lmdb", host_cache=8) as writer:
        writer.put([1], torch.ones(1, 4))
        writer.flush()
        with pytest.raises(StoreBusyError, match="already open in this process.*in another process"):
            TieredStore(tmp_path / "s", read_only=True, host_cache=8)
        writer.put([2], torch.ones(1, 4))  # the writer goes on
    with TieredStore(tmp_path / "s", read_only=True, host_cache=8) as reader:  # once closed: allowed
        assert len(reader) == 2


# -- the command line: usage errors (exit 2) before any output is written ------------------------------


def run(*args):
    return main([str(arg) for arg in args])


@pytest.fixture
def traces(tmp_path):
    np.save(tmp_path / "ids.npy", np.arange(2000) % 300)
    np.save(tmp_path / "floats.npy", np.array([1.5, 2.0]))
    (tmp_path / "avazu.csv").write_text(
        "id,C20\n" + "".join(f"{i},{[-1, 7, -1, 9][i % 4]}\n" for i in range(40))
    )
    (tmp_path / "huge.csv").write_text("a\n1\n2\n99999999999999999999999\n")
    (tmp_path / "two.csv").write_text("a,b\n" + "".join(f"{i % 2},{i}\n" for i in range(400)))
    return tmp_path


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["zipf:n=10,n=20,length=100"], "option 'n' is given twice"),
        (["drift:n=100,hot=200,length=100"], r"hot \(200 ids\) must be at most n \(100\)"),
        (["{t}/ids.npy", "--columns", "a"], "columns apply to CSV/TSV traces only"),
        (["zipf:n=100,length=100", "--criteo"], "criteo apply to CSV/TSV traces only"),
        (["{t}/ids.npy", "--delimiter", ""], "the delimiter must be one character"),
        (["{t}/two.csv", "--columns", "a", "--delimiter", ";;"], "the delimiter must be one character"),
        (["{t}/huge.csv", "--columns", "a"], r"line 4: '99999999999999999999999' in column 0 is past int64"),
        (["{t}/two.csv", "--columns", "a,b", "--separate"], r"two.csv \[a\]: cache size '1%' holds no rows"),
        (["{t}/ids.npy", "--warm", "{t}/floats.npy"], "warm: .*floats.npy does not hold ids"),
        (["{t}/ids.npy", "--admission", "256"], r"--admission must be in \[0, 255\]"),
    ],
)
def test_bench_usage_errors_exit_2_and_write_nothing(traces, capsys, arguments, message):
    arguments = [argument.format(t=traces) for argument in arguments]
    assert run("bench", *arguments, "--quiet", "--out", traces / "out") == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (traces / "out.json").exists() and not list(traces.glob("out*.png"))


def test_a_negative_category_in_a_csv_is_a_category_like_any_other(traces, capsys):
    """Avazu's C20 has -1 as a real category: its lookups are counted, not dropped as empty."""
    assert (
        run(
            "bench",
            traces / "avazu.csv",
            "--columns",
            "C20",
            "--sizes",
            "1",
            "--quiet",
            "--out",
            traces / "o",
        )
        == 0
    )
    report = json.loads((traces / "o.json").read_text())
    assert report["accesses"] == 40 and report["distinct_ids"] == 3


# -- collections: a missing group, a half-done flush, a damaged layout ------------------------------


def made_collection(root, backend="mmap"):
    """A collection at ``root`` holding rows in both groups, flushed and closed; returns its rows."""
    with closing(TieredEmbeddingBagCollection(TABLES, path=root, backend=backend, host_cache=64)) as made:
        made(kjt(["item", "user", "ad"], [1, 2, 3, 4, 5, 6], [1, 1, 1, 1, 1, 1])).values().sum().backward()
        return collection_state(made)


@pytest.mark.parametrize("backend", ["mmap", "lmdb"])
@pytest.mark.parametrize("removed", ["dim8", "dim8/tierstore.json", "data file"])
def test_a_collection_whose_group_store_is_gone_is_refused_not_reopened_empty(
    tmp_path, capsys, backend, removed
):
    root = tmp_path / "c"
    made_collection(root, backend)
    if removed == "data file":
        os.remove(root / "dim8" / ("rows.bin" if backend == "mmap" else "lmdb/data.mdb"))
    elif removed == "dim8":
        shutil.rmtree(root / "dim8")
    else:
        os.remove(root / removed)
    files = files_of(root)
    with pytest.raises(StoreFormatError, match="dim8.* is missing"):
        TieredEmbeddingBagCollection(TABLES, path=root, host_cache=64)
    assert files_of(root) == files
    assert run("verify", root) == 1
    assert "dim8" in capsys.readouterr().out


KILLED_INSIDE_FLUSH = textwrap.dedent(
    """
    import os, sys, torch
    from tierstore import EmbeddingBagConfig, KeyedJaggedTensor, TieredEmbeddingBagCollection
    from tierstore.nn import collection
    tables = [EmbeddingBagConfig(None, 4, "items", ["item"]), EmbeddingBagConfig(100, 4, "users", ["user"]),
              EmbeddingBagConfig(50, 8, "ads", ["ad"])]
    made = TieredEmbeddingBagCollection(tables, path=sys.argv[1], backend=sys.argv[2], host_cache=64)
    features = KeyedJaggedTensor(["item", "ad"], torch.tensor([7, 9]), lengths=torch.tensor([1, 1]))
    made(features).values().sum().backward()
    if sys.argv[3] == "between groups":  # killed once dim4 has committed, before dim8 does
        made.groups["dim8"].store.flush = lambda: os._exit(9)
    else:  # killed once every group has committed, before the flush record says complete
        begin = collection.write_flush_record
        collection.write_flush_record = lambda root, counts, complete: complete and os._exit(9) or begin(
            root, counts, complete
        )
    made.flush()
    """
)


def kill_inside_flush(root, backend, when):
    command = [sys.executable, "-c", KILLED_INSIDE_FLUSH, str(root), backend, when]
    return subprocess.run(command, capture_output=True)


@pytest.mark.parametrize("backend", ["mmap", "lmdb"])
def test_a_kill_between_two_groups_commits_is_named_on_reopening(tmp_path, capsys, backend):
    root = tmp_path / "c"
    made_collection(root, backend)
    killed = kill_inside_flush(root, backend, "between groups")
    assert killed.returncode == 9, killed.stderr
    files = files_of(root)
    counts = r"dim4 at flush 2 \(was 1\), dim8 at flush 1 \(was 1\)"
    with pytest.raises(StoreFormatError, match=counts):
        TieredEmbeddingBagCollection(TABLES, path=root, host_cache=64)
    assert files_of(root) == files  # refusing wrote nothing
    assert run("verify", root) == 1 and "groups hold different flushes" in capsys.readouterr().out
    os.remove(root / "flushes.json")  # the way out the message names: accept the groups as they are
    with closing(TieredEmbeddingBagCollection(TABLES, path=root, host_cache=64)) as reopened:
        stores = reopened.groups["dim4"].store, reopened.groups["dim8"].store
        assert (len(stores[0]), len(stores[1])) == (5, 2)  # item 7 was committed, ad 9 was not
    with closing(TieredEmbeddingBagCollection(TABLES, path=root, host_cache=64)):
        pass  # and opens again from then on


@pytest.mark.parametrize("backend", ["mmap", "lmdb"])
def test_a_kill_after_every_group_committed_reopens_at_that_flush(tmp_path, backend):
    root = tmp_path / "c"
    before = made_collection(root, backend)
    killed = kill_inside_flush(root, backend, "after the groups")
    assert killed.returncode == 9, killed.stderr
    with closing(TieredEmbeddingBagCollection(TABLES, path=root, host_cache=64)) as reopened:
        after = collection_state(reopened)
    assert [len(group[1]) for group in after] == [len(group[1]) + 1 for group in before]  # item 7, ad 9


def test_a_damaged_layout_file_is_a_format_error_naming_it(tmp_path, capsys):
    root = tmp_path / "c"
    made_collection(root)
    (root / "collection.json").write_text('{"tables": [{"name": ')
    with pytest.raises(StoreFormatError, match="collection.json is damaged"):
        TieredEmbeddingBagCollection(TABLES, path=root, host_cache=64)
    for command in ("inspect", "verify"):
        assert run(command, root) in (1, 2)
        captured = capsys.readouterr()
        assert "collection.json is damaged" in captured.out + captured.err


def test_verify_checks_every_group_of_a_sound_or_damaged_collection(tmp_path, capsys):
    root = tmp_path / "c"
    made_collection(root)
    assert run("verify", root) == 0 and f"{root}: sound" in capsys.readouterr().out
    rows_file = root / "dim8" / "rows.bin"
    data = bytearray(rows_file.read_bytes())
    data[3] ^= 0xFF  # a byte of the first stored row of the ads table
    rows_file.write_bytes(bytes(data))
    assert run("verify", root) == 1
    out = capsys.readouterr().out
    assert "problem: dim8: " in out and "checksum" in out and "dim4" not in out


@pytest.mark.parametrize("command", [["export", "{c}", "{t}/out.npy"], ["import", "{t}/rows.npy", "{c}"]])
def test_a_collection_without_table_says_which_tables_to_pass(tmp_path, capsys, command):
    root = tmp_path / "c"
    made_collection(root)
    np.save(tmp_path / "rows.npy", np.ones((3, 4), dtype=np.float32))
    files = files_of(root)
    assert run(*[part.format(c=root, t=tmp_path) for part in command]) == 2
    assert (
        "is a collection of the tables ['items', 'users', 'ads']: pass --table NAME"
        in capsys.readouterr().err
    )
    assert files_of(root) == files and not (tmp_path / "out.npy").exists()


# -- signals: damage LMDB does not check ends a process; it must end only a child --------------------


def cli_in_a_subprocess(*args):
    """``tierstore ARGS`` as a user runs it: a signal would be a negative return code."""
    command = [sys.executable, "-m", "tierstore", *map(str, args), "--quiet"]
    return subprocess.run(command, capture_output=True, text=True)


def lmdb_store_with_scrambled_leaves(path):
    """An LMDB store whose leaf pages holding id 1500 claim to be branch pages (their header
    otherwise intact): LMDB's cursor asserts on them and aborts the process (SIGABRT)."""
    with TieredStore(path, dim=8, backend="lmdb", host_cache=64) as store:
        store.put(torch.arange(3000), torch.randn(3000, 8))
    data_file = path / "lmdb" / "data.mdb"
    data = bytearray(data_file.read_bytes())
    for page in range(2, len(data) // 4096):
        start = page * 4096
        if int.from_bytes(data[start : start + 8], "little") == page and data[start + 10] == 0x02:
            if (1500).to_bytes(8, "big") in data[start : start + 4096]:
                data[start + 10] = 0x01  # P_LEAF -> P_BRANCH
    data_file.write_bytes(bytes(data))


@pytest.mark.parametrize("command", ["verify", "export", "inspect"])
def test_the_cli_turns_lmdb_aborting_on_a_scrambled_page_into_a_clear_error(tmp_path, command):
    lmdb_store_with_scrambled_leaves(tmp_path / "s")
    files = files_of(tmp_path / "s")
    extra = [tmp_path / "out.npy"] if command == "export" else []
    result = cli_in_a_subprocess(command, tmp_path / "s", *extra)
    assert result.returncode >= 0, result.stderr  # no signal
    damage = "ends a process with SIGABRT inside LMDB: its data is damaged .* restore the store"
    if command == "verify":
        assert result.returncode == 1 and re.search(damage, result.stdout)
    elif command == "export":
        assert result.returncode == 2 and re.search(damage, result.stderr)
        assert not (tmp_path / "out.npy").exists()  # refused before anything is written
    else:
        assert result.returncode == 2 and re.search(damage, result.stderr)
    assert files_of(tmp_path / "s") == files


@pytest.mark.parametrize(
    "damage, message",
    [
        ("version", "neither LMDB meta page is valid"),
        ("root page number", "its root page .* is not a B-tree page"),
        ("root outside the file", "neither LMDB meta page is valid"),
    ],
)
def test_damaged_lmdb_meta_and_root_pages_are_refused_before_lmdb_maps_them(tmp_path, damage, message):
    with TieredStore(tmp_path / "s", dim=8, backend="lmdb", host_cache=64) as store:
        store.put(torch.arange(3000), torch.randn(3000, 8))
    data_file = tmp_path / "s" / "lmdb" / "data.mdb"
    data = bytearray(data_file.read_bytes())
    for meta in (0, 4096):
        root = int.from_bytes(data[meta + 128 : meta + 136], "little")
        if damage == "version":
            data[meta + 20] = 7
        elif damage == "root outside the file":
            data[meta + 128 : meta + 136] = (10**9).to_bytes(8, "little")
        else:
            data[root * 4096 : root * 4096 + 8] = (root + 1).to_bytes(8, "little")
    data_file.write_bytes(bytes(data))
    for command in (["inspect"], ["verify"], ["export", tmp_path / "out.npy"]):
        result = cli_in_a_subprocess(command[0], tmp_path / "s", *command[1:])
        assert result.returncode in (1, 2) and re.search(message, result.stdout + result.stderr), result
    with pytest.raises(StoreFormatError, match=message):
        TieredStore(tmp_path / "s", host_cache=8)
