"""Point-in-time checkpoints (``table.checkpoint`` / ``restore``): a checkpoint holds every row,
its optimizer state and the step count as of one flush while training goes on, and restoring it in
a fresh process resumes exactly as a run never interrupted; a kill while one is written leaves the
store and earlier checkpoints whole."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from tierstore import (
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    TieredEmbeddingBag,
    TieredEmbeddingBagCollection,
    TieredStore,
)
from tierstore.checkpoint import TableCheckpoint
from tierstore.optim import SGD, Adagrad, Adam

BACKENDS = ["mmap", "lmdb"]
OPTIMIZERS = {"sgd": lambda: SGD(lr=0.1), "adagrad": lambda: Adagrad(lr=0.1), "adam": lambda: Adam(lr=0.01)}


def batches(count, seed=0, ids_below=400):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, ids_below, (24, 3), generator=generator) for _ in range(count)]


def train(table, inputs):
    for ids in inputs:
        table(ids).pow(2).sum().backward()


def all_rows(store):
    """``{id: whole row}`` of every row the store holds."""
    return {
        int(key): row.clone() for ids, rows in store.iter_rows(with_state=True) for key, row in zip(ids, rows)
    }


def same_rows(first, second):
    """Bit for bit (a half row's float32 state, read as halves, may hold NaN patterns)."""
    return first.keys() == second.keys() and all(
        torch.equal(first[key].view(torch.uint8), second[key].view(torch.uint8)) for key in first
    )


def table(path, backend, optimizer, dtype=torch.float32, rows=48):
    return TieredEmbeddingBag(
        None,
        8,
        path=path,
        backend=backend,
        optimizer=OPTIMIZERS[optimizer](),
        host_cache=rows * 200,
        dtype=dtype,
    )


RESUME = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, sys.argv[4])
    from test_checkpoint import table, train, batches
    store, checkpoint, backend, _, optimizer, out = sys.argv[1:]
    resumed = table(store, backend, optimizer)
    resumed.restore(checkpoint)
    step = resumed.step
    train(resumed, batches(9)[step:])
    ids, rows = (torch.cat(part) for part in zip(*resumed.store.iter_rows(with_state=True)))
    torch.save({"step": step, "ids": ids, "rows": rows, "after": resumed.step}, out)
    resumed.close()
    """
)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_checkpoint_restored_in_a_fresh_process_resumes_as_a_run_never_interrupted(
    tmp_path, backend, optimizer
):
    """Checkpoint after 4 steps in the background while 3 more train (the cache a few rows, so
    rows move through every tier meanwhile); a fresh process restores it into the same store (so
    rows added since must go) and trains the last 5 batches: every row and its optimizer state
    equal, bit for bit, those of a table trained on all 9 batches without a break."""
    inputs = batches(9)
    interrupted = table(tmp_path / "store", backend, optimizer)
    train(interrupted, inputs[:4])
    at_four = all_rows(interrupted.store)
    writing = interrupted.checkpoint(tmp_path / "checkpoint", background=True)
    train(interrupted, inputs[4:7])
    assert writing.wait() == tmp_path / "checkpoint"
    saved = TableCheckpoint(tmp_path / "checkpoint")
    assert saved.step == 4 and len(saved) == len(at_four)
    assert same_rows(
        at_four, {int(key): row for ids, rows in saved.iter_rows(50) for key, row in zip(ids, rows)}
    )
    interrupted.close()

    out = tmp_path / "resumed.pt"
    script = [sys.executable, "-c", RESUME, str(tmp_path / "store"), str(tmp_path / "checkpoint"), backend]
    result = subprocess.run(
        [*script, os.path.dirname(__file__), optimizer, str(out)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    resumed = torch.load(out)
    assert resumed["step"] == 4 and resumed["after"] == 9

    uninterrupted = table(tmp_path / "uninterrupted", backend, optimizer)
    train(uninterrupted, inputs)
    expected = all_rows(uninterrupted.store)
    uninterrupted.close()
    assert same_rows(expected, {int(key): row for key, row in zip(resumed["ids"], resumed["rows"])})


@pytest.mark.parametrize("backend", BACKENDS)
def test_restoring_removes_rows_added_since_and_undoes_updates_since(tmp_path, backend):
    embedding = table(tmp_path / "store", backend, "adagrad")
    train(embedding, batches(3, ids_below=100))
    before = all_rows(embedding.store)
    embedding.checkpoint(tmp_path / "checkpoint")
    train(embedding, batches(3, seed=1, ids_below=300))  # ids up to 300: new rows
    embedding.store.put(torch.tensor([10_000]), torch.ones(1, 8))  # staged, never flushed
    assert len(embedding.store) > len(before)
    embedding.restore(tmp_path / "checkpoint")
    assert same_rows(before, all_rows(embedding.store)) and embedding.step == 3
    assert not bool(embedding.store.contains(torch.tensor([10_000]))[0])
    embedding.close()
    reopened = table(tmp_path / "store", backend, "adagrad")  # the restored rows are durable
    assert same_rows(before, all_rows(reopened.store))
    reopened.close()


def test_a_checkpoint_is_never_overwritten_and_a_layout_that_differs_is_refused_before_any_change(tmp_path):
    embedding = table(tmp_path / "store", "mmap", "adagrad")
    train(embedding, batches(2))
    embedding.checkpoint(tmp_path / "checkpoint")
    with pytest.raises(FileExistsError, match="never overwritten"):
        embedding.checkpoint(tmp_path / "checkpoint")
    other = TieredEmbeddingBag(None, 8, path=tmp_path / "sgd", optimizer=SGD(lr=0.1))
    train(other, batches(1))
    rows = all_rows(other.store)
    with pytest.raises(ValueError, match="optimizer_state_width 8 .the table's: 0"):
        other.restore(tmp_path / "checkpoint")
    assert same_rows(rows, all_rows(other.store))
    with pytest.raises(FileNotFoundError, match="not a tierstore checkpoint"):
        other.restore(tmp_path / "store")
    for closing in (embedding, other):
        closing.close()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_rows_and_their_float32_state_round_trip_exactly(tmp_path, dtype):
    embedding = table(tmp_path / "store", "mmap", "adam", dtype=dtype)
    train(embedding, batches(3))
    before = all_rows(embedding.store)
    embedding.checkpoint(tmp_path / "checkpoint")
    saved = np.load(tmp_path / "checkpoint" / "rows.npy", mmap_mode="r")
    assert saved.dtype == (np.uint16 if dtype == torch.bfloat16 else np.float16)
    train(embedding, batches(2, seed=3))
    embedding.restore(tmp_path / "checkpoint")
    assert same_rows(before, all_rows(embedding.store))
    embedding.close()


def test_a_collection_checkpoints_and_restores_every_group(tmp_path):
    configs = [
        EmbeddingBagConfig(name="small", embedding_dim=4, num_embeddings=50, feature_names=["a"]),
        EmbeddingBagConfig(name="large", embedding_dim=8, num_embeddings=10**6, feature_names=["b"]),
    ]
    collection = TieredEmbeddingBagCollection(configs, path=tmp_path / "store", optimizer=Adagrad(lr=0.1))

    def step(seed):
        generator = torch.Generator().manual_seed(seed)
        values = torch.cat(
            [
                torch.randint(0, 50, (16,), generator=generator),
                torch.randint(0, 10**6, (16,), generator=generator),
            ]
        )
        features = KeyedJaggedTensor(keys=["a", "b"], values=values, lengths=torch.full((8,), 4))
        collection(features).values().pow(2).sum().backward()

    for seed in range(3):
        step(seed)
    before = {name: all_rows(group.store) for name, group in collection.groups.items()}
    collection.checkpoint(tmp_path / "checkpoint")
    assert sorted(path.name for path in (tmp_path / "checkpoint").iterdir()) == ["dim4", "dim8"]
    for seed in range(3, 6):
        step(seed)
    collection.restore(tmp_path / "checkpoint")
    for name, group in collection.groups.items():
        assert same_rows(before[name], all_rows(group.store)) and group.step == 3

    dcp = pytest.importorskip("torch.distributed.checkpoint")  # the same through dcp, into new stores
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"tables": collection}, checkpoint_id=tmp_path / "dcp")
    step(6)
    loaded = TieredEmbeddingBagCollection(configs, path=tmp_path / "other", optimizer=Adagrad(lr=0.1))
    with pytest.warns(UserWarning, match="single process"):
        dcp.load({"tables": loaded}, checkpoint_id=tmp_path / "dcp")
    for name, group in loaded.groups.items():
        assert same_rows(before[name], all_rows(group.store)) and group.step == 3
    for closing in (collection, loaded):
        closing.close()


CHECKPOINT_WRITER = """
import os, signal, sys, time, torch
sys.path.insert(0, sys.argv[3])
import tierstore.checkpoint
from tierstore.snapshot import StoreSnapshot
from test_checkpoint import table, train, batches
tierstore.checkpoint.WRITE_ROWS = 16
embedding = table(sys.argv[1], sys.argv[2], "adagrad")
train(embedding, batches({steps}))
rows = StoreSnapshot.iter_rows
"""  # a table trained {steps} steps, checkpointed in parts of 16 rows; the script goes on from there

KILLED_WHILE_WRITING = CHECKPOINT_WRITER.format(steps=6) + textwrap.dedent(
    """
    def killed_on_the_third_part(self, batch_size):
        for number, part in enumerate(rows(self, batch_size)):
            if number == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            yield part

    StoreSnapshot.iter_rows = killed_on_the_third_part
    writing = embedding.checkpoint(sys.argv[1] + ".second", background=True)
    train(embedding, batches(3, seed=1))
    writing.wait()
    """
)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_kill_while_a_checkpoint_is_written_leaves_the_store_and_the_earlier_checkpoint_whole(
    tmp_path, backend
):
    store = tmp_path / "store"
    embedding = table(store, backend, "adagrad")
    train(embedding, batches(2))
    embedding.checkpoint(tmp_path / "first")
    first = all_rows(embedding.store)
    embedding.close()
    script = [sys.executable, "-c", KILLED_WHILE_WRITING, str(store), backend, os.path.dirname(__file__)]
    result = subprocess.run(script, capture_output=True, text=True)
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert not (tmp_path / "store.second").exists()  # no checkpoint, only its partial directory
    assert [path.name for path in tmp_path.iterdir() if path.name.startswith(".store.second.partial")]

    reopened = table(store, backend, "adagrad")  # the store: its last flush (the one the snapshot took)
    expected = table(tmp_path / "expected", backend, "adagrad")
    train(expected, batches(2) + batches(6))
    assert same_rows(all_rows(expected.store), all_rows(reopened.store))
    reopened.restore(tmp_path / "first")  # the earlier checkpoint
    assert same_rows(first, all_rows(reopened.store))
    info = json.loads((tmp_path / "first" / "checkpoint.json").read_text())
    assert info["rows"] == len(first) and info["step"] == 2
    for closing in (reopened, expected):
        closing.close()


EXITS_WHILE_WRITING = CHECKPOINT_WRITER.format(steps=4) + textwrap.dedent(
    """
    def slowly(self, batch_size):
        for part in rows(self, batch_size):
            time.sleep(0.05)
            yield part

    StoreSnapshot.iter_rows = slowly
    writing = embedding.checkpoint(sys.argv[1] + ".checkpoint", background=True)
    print("still writing" if not writing.done() else "written")
    """
)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_checkpoint_still_being_written_when_the_program_ends_is_completed(tmp_path, backend):
    """Its thread is waited for at the interpreter's exit, as a program that never called
    ``wait()`` expects: the checkpoint is whole, with the rows of its snapshot."""
    store = tmp_path / "store"
    script = [sys.executable, "-c", EXITS_WHILE_WRITING, str(store), backend, os.path.dirname(__file__)]
    result = subprocess.run(script, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "still writing"
    assert not [path for path in tmp_path.iterdir() if ".partial" in path.name]
    expected = table(tmp_path / "expected", backend, "adagrad")
    train(expected, batches(4))
    restored = table(tmp_path / "restored", backend, "adagrad")
    restored.restore(tmp_path / "store.checkpoint")
    assert same_rows(all_rows(expected.store), all_rows(restored.store))
    for closing in (expected, restored):
        closing.close()


class Model(torch.nn.Module):
    """A tiered table under a dense layer, as a model holds one."""

    def __init__(self, path, backend="mmap", dim=8):
        super().__init__()
        self.embedding = TieredEmbeddingBag(
            None, dim, path=path, backend=backend, optimizer=Adagrad(lr=0.1), host_cache=48 * 200
        )
        self.dense = torch.nn.Linear(dim, 1)

    def forward(self, ids):
        return self.dense(self.embedding(ids)).sum()


def train_model(model, inputs):
    for ids in inputs:
        model(ids).backward()


@pytest.fixture
def small_chunks(monkeypatch):
    """dcp.save writes a table's rows in chunks of 10 rows (and reads them back as many)."""
    from tierstore.nn import table_rows

    monkeypatch.setattr(table_rows, "CHUNK_BYTES", 10 * (8 + 16 * 4))


@pytest.mark.parametrize("backend", BACKENDS)
def test_dcp_saves_the_rows_of_the_moment_and_loads_them_into_a_model_on_an_empty_store(
    tmp_path, backend, small_chunks
):
    """``dcp.save({"model": model})`` mid-run captures the table's rows, optimizer state and step
    with the dense weights; training goes on; ``dcp.load`` into a model built on a new, empty store
    gives it exactly those, and it then trains exactly as the uninterrupted model."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    inputs = batches(8)
    model = Model(tmp_path / "store", backend)
    train_model(model, inputs[:4])
    saved_rows, saved_dense = all_rows(model.embedding.store), model.dense.weight.detach().clone()
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"model": model}, checkpoint_id=tmp_path / "dcp")
    train_model(model, inputs[4:])

    loaded = Model(tmp_path / "other", backend)
    loaded(inputs[7])  # a row of its own, which the load removes
    with pytest.warns(UserWarning, match="single process"):
        dcp.load({"model": loaded}, checkpoint_id=tmp_path / "dcp")
    assert same_rows(saved_rows, all_rows(loaded.embedding.store)) and loaded.embedding.step == 4
    assert torch.equal(loaded.dense.weight, saved_dense)
    train_model(loaded, inputs[4:])
    assert same_rows(all_rows(model.embedding.store), all_rows(loaded.embedding.store))

    with pytest.warns(UserWarning, match="single process"):  # into the model that went on: back to step 4
        dcp.load({"model": model}, checkpoint_id=tmp_path / "dcp")
    assert same_rows(saved_rows, all_rows(model.embedding.store)) and model.embedding.step == 4
    for closing in (model, loaded):
        closing.embedding.close()


def test_dcp_load_into_a_table_of_another_layout_is_refused_before_any_change(tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    model = Model(tmp_path / "store")
    train_model(model, batches(2))
    with pytest.warns(UserWarning):
        dcp.save({"model": model.embedding}, checkpoint_id=tmp_path / "dcp")
    wider = Model(tmp_path / "wider", dim=16)  # rows of other bytes: dcp refuses them
    train_model(wider, batches(1))
    before = all_rows(wider.embedding.store)
    with pytest.raises(CheckpointException, match="Size mismatch"), pytest.warns(UserWarning):
        dcp.load({"model": wider.embedding}, checkpoint_id=tmp_path / "dcp")
    assert same_rows(before, all_rows(wider.embedding.store))
    # rows of the same bytes, another layout (dim 16 and SGD: 16 floats; dim 8 and Adagrad: 8 + 8)
    plain = TieredEmbeddingBag(None, 16, path=tmp_path / "plain", optimizer=SGD(lr=0.1))
    train(plain, batches(1))
    before = all_rows(plain.store)
    with pytest.raises(ValueError, match="dim is 8 but this module's is 16"), pytest.warns(UserWarning):
        dcp.load({"model": plain}, checkpoint_id=tmp_path / "dcp")
    assert same_rows(before, all_rows(plain.store))
    assert not [path for path in tmp_path.iterdir() if ".incoming-" in path.name]
    for closing in (model.embedding, wider.embedding, plain):
        closing.close()


def test_a_state_dict_holds_the_rows_of_its_moment_and_pickles_as_the_stores_location(tmp_path):
    """``state_dict()``'s ``rows`` entry is a snapshot: loading it later restores that moment's
    rows, whatever trained since. ``torch.save`` of a state dict leaves the rows out (it names the
    store, as before), and reloading it resumes from the store."""
    model = Model(tmp_path / "store")
    train_model(model, batches(2))
    moment = all_rows(model.embedding.store)
    state = model.state_dict()
    assert tuple(state["embedding.rows"].shape) == (len(moment), 8 + 16 * 4)
    train_model(model, batches(2, seed=5))
    latest = all_rows(model.embedding.store)
    model.load_state_dict(state)
    assert same_rows(moment, all_rows(model.embedding.store))
    train_model(model, batches(2, seed=5))
    torch.save(model.state_dict(), tmp_path / "state.pt")
    pickled = torch.load(tmp_path / "state.pt", weights_only=False)
    assert pickled["embedding.rows"] is None
    model.load_state_dict(pickled)
    assert same_rows(latest, all_rows(model.embedding.store))
    with pytest.raises(RuntimeError, match="records of a store snapshot"):
        state["embedding.rows"] + 1
    model.embedding.close()


def test_a_snapshot_after_a_load_that_could_not_go_in_bulk_does_not_wait_on_its_own_store(tmp_path):
    """``load`` of ids the store holds asks for the bulk path (readers held out) and then stages the
    rows instead: the snapshot's reader must not wait on the lock its own writer still holds."""
    store = TieredStore(tmp_path / "store", 4, backend="mmap", host_cache=64)
    store.load(torch.arange(10), torch.ones(10, 4))
    store.load(torch.arange(5), torch.full((5, 4), 2.0))
    with store.snapshot() as snapshot:
        ids, rows = snapshot.read(0, 10)
    assert sorted(ids.tolist()) == list(range(10)) and sorted(rows[:, 0].tolist()) == [1.0] * 5 + [2.0] * 5
    store.close()


def test_an_lmdb_restore_commits_batch_by_batch_so_its_staging_stays_one_batch(tmp_path, monkeypatch):
    """Restoring into LMDB stages rows in a log indexed in RAM: committed a batch at a time, its
    memory stays one batch's whatever the table's size (all at once, a 1.4M-row restore was killed
    under a 600 MiB limit that training and the checkpoint itself ran in)."""
    monkeypatch.setattr(TableCheckpoint.iter_rows, "__defaults__", (10,))  # the restore's batches
    embedding = table(tmp_path / "store", "lmdb", "adagrad")
    train(embedding, batches(2))
    before = all_rows(embedding.store)
    embedding.checkpoint(tmp_path / "checkpoint")
    train(embedding, batches(1, seed=4))
    embedding.restore(tmp_path / "checkpoint")
    assert same_rows(before, all_rows(embedding.store))
    assert embedding.store.flushes >= -(-len(before) // 10)  # a commit per batch of 10 rows
    embedding.close()


def test_a_checkpoint_holds_the_device_tiers_rows_and_a_restore_drops_them(tmp_path, device_tier):
    """With a device tier of a few rows (rows move through all three tiers every step), a checkpoint
    holds the rows as of its flush, those cached on the device included; a restore drops the device
    tier's rows, and training on from it equals a run never interrupted, bit for bit."""

    def tiered(path):
        return TieredEmbeddingBag(
            None, 8, path=path, optimizer=Adagrad(lr=0.1), host_cache=96, device_cache=64, **device_tier
        )

    def train_on(table, inputs):
        for ids in inputs:
            table(ids.to(device_tier["device"])).pow(2).sum().backward()

    inputs = batches(7, ids_below=200)
    interrupted = tiered(tmp_path / "store")
    train_on(interrupted, inputs[:3])
    interrupted.checkpoint(tmp_path / "checkpoint")
    at_three = all_rows(interrupted.store)
    train_on(interrupted, inputs[3:5])
    interrupted.restore(tmp_path / "checkpoint")
    assert interrupted.step == 3 and same_rows(at_three, all_rows(interrupted.store))
    train_on(interrupted, inputs[3:])

    uninterrupted = tiered(tmp_path / "uninterrupted")
    train_on(uninterrupted, inputs)
    assert same_rows(all_rows(uninterrupted.store), all_rows(interrupted.store))
    for closing in (interrupted, uninterrupted):
        closing.close()


DISK_FULL = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, sys.argv[4])
    from test_checkpoint import table, train, batches, all_rows, same_rows
    store, target, background = sys.argv[1], sys.argv[2], sys.argv[3] == "True"
    embedding = table(store, "mmap", "adam")
    embedding.store.put(torch.arange(30_000), torch.rand(30_000, 8))
    rows = all_rows(embedding.store)
    try:
        writing = embedding.checkpoint(target, background=background)
        assert background, "a checkpoint written in the call raises there"
        writing.wait()
    except OSError as error:
        print(type(error).__name__, error.strerror)
    assert same_rows(rows, all_rows(embedding.store))
    train(embedding, batches(1))
    assert embedding.checkpoint(store + ".elsewhere").wait()
    embedding.close()
    """
)


@pytest.mark.parametrize("background", [False, True])
def test_a_checkpoint_that_fills_the_disk_raises_and_leaves_nothing_at_its_path(
    tmp_path, tiny_filesystem, background
):
    """A 2 MiB filesystem cannot hold 30,000 rows of 24 values: the write raises ``OSError``
    (ENOSPC), synchronously from ``checkpoint`` or from ``wait()``, in a process that lives on (a
    checkpoint written through a memory map died of SIGBUS there); no checkpoint and no partial
    directory is left, the store's rows are unchanged, and it trains on and checkpoints elsewhere."""
    script = [sys.executable, "-c", DISK_FULL, str(tmp_path / "store"), str(tiny_filesystem / "checkpoint")]
    result = subprocess.run(
        [*script, str(background), os.path.dirname(__file__)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "OSError No space left on device"
    assert list(tiny_filesystem.iterdir()) == []
    assert (tmp_path / "store.elsewhere" / "checkpoint.json").exists()
