"""Delta exports (``tierstore export --since CHECKPOINT``) and their application to a replica
(``tierstore apply-delta``): a replica imported from an older export and brought on by the deltas in
order holds exactly the rows a full export of the newer store holds, removed ids included."""

import pytest
import torch

from tierstore import EmbeddingBagConfig, KeyedJaggedTensor, TieredEmbeddingBag, TieredEmbeddingBagCollection
from tierstore.cli.commands import main
from tierstore.cli.table_files import open_table
from tierstore.optim import Adagrad

FORMATS = [".pt", ".safetensors", ".npy"]


def train(table, seed, ids_below, steps=3):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        table(torch.randint(0, ids_below, (16, 3), generator=generator)).pow(2).sum().backward()


def exported(path, suffix):
    """``{id: row}`` of an export file (ids beside a .npy)."""
    ids_path = path.with_name(path.stem + ".ids.npy") if suffix == ".npy" else None
    source = open_table(path, ids_path=ids_path)
    ids = torch.arange(len(source)) if source.ids is None else source.ids
    return {int(key): row.clone() for key, row in zip(ids, source.rows[:])}


def export(store, path, suffix, *options):
    ids = ["--ids", str(path.with_name(path.stem + ".ids.npy"))] if suffix == ".npy" else []
    removed = (
        ["--removed", str(path.with_name(path.stem + ".removed.npy"))]
        if suffix == ".npy" and "--since" in options
        else []
    )
    assert main(["export", str(store), str(path), "--quiet", *ids, *removed, *options]) == 0


def apply(replica, delta, suffix, *options):
    files = []
    if suffix == ".npy":
        files = [
            "--ids",
            str(delta.with_name(delta.stem + ".ids.npy")),
            "--removed",
            str(delta.with_name(delta.stem + ".removed.npy")),
        ]
    assert main(["apply-delta", str(replica), str(delta), "--quiet", *files, *options]) == 0


@pytest.mark.parametrize("suffix", FORMATS)
def test_deltas_applied_in_order_to_an_older_export_give_the_newer_one(tmp_path, suffix):
    """A table trains, is checkpointed and exported; it trains on, is restored to an older
    checkpoint (so ids it held go) and trains on other ids; two deltas capture that. A replica
    imported from the first export and brought on by both deltas equals a full export of the end."""
    table = TieredEmbeddingBag(
        None, 4, path=tmp_path / "store", optimizer=Adagrad(lr=0.1), host_cache=20 * 200
    )
    train(table, 0, 100)
    table.checkpoint(tmp_path / "old")
    train(table, 1, 300)  # ids up to 300
    table.checkpoint(tmp_path / "first")
    table.close()
    export(tmp_path / "store", tmp_path / f"first{suffix}", suffix)

    table = TieredEmbeddingBag(
        None, 4, path=tmp_path / "store", optimizer=Adagrad(lr=0.1), host_cache=20 * 200
    )
    table.restore(tmp_path / "old")  # the ids above 100 learnt since "old" go
    train(table, 2, 150)
    table.close()
    export(tmp_path / "store", tmp_path / f"delta1{suffix}", suffix, "--since", str(tmp_path / "first"))
    table = TieredEmbeddingBag(
        None, 4, path=tmp_path / "store", optimizer=Adagrad(lr=0.1), host_cache=20 * 200
    )
    table.checkpoint(tmp_path / "second")
    train(table, 3, 400)
    table.close()
    export(tmp_path / "store", tmp_path / f"delta2{suffix}", suffix, "--since", str(tmp_path / "second"))
    export(tmp_path / "store", tmp_path / f"last{suffix}", suffix)

    first, last = exported(tmp_path / f"first{suffix}", suffix), exported(tmp_path / f"last{suffix}", suffix)
    delta1 = exported(tmp_path / f"delta1{suffix}", suffix)
    assert 0 < len(delta1) < len(last) and set(first) - set(last)  # a part of the rows; some ids went
    ids = ["--ids", str(tmp_path / "first.ids.npy")] if suffix == ".npy" else []
    assert main(["import", str(tmp_path / f"first{suffix}"), str(tmp_path / "replica"), "--quiet", *ids]) == 0
    apply(tmp_path / "replica", tmp_path / f"delta1{suffix}", suffix)
    apply(tmp_path / "replica", tmp_path / f"delta2{suffix}", suffix)
    export(tmp_path / "replica", tmp_path / f"replica{suffix}", suffix)
    replica = exported(tmp_path / f"replica{suffix}", suffix)
    assert replica.keys() == last.keys() and all(torch.equal(replica[key], last[key]) for key in last)


def test_a_delta_of_whole_rows_brings_a_replicas_optimizer_state_on_exactly(tmp_path):
    """A replica restored from a checkpoint, brought on by a ``--with-state`` delta: every whole row
    (weights and Adagrad state) equals the trained store's."""
    make = lambda path: TieredEmbeddingBag(None, 4, path=path, optimizer=Adagrad(lr=0.1), host_cache=20 * 200)  # noqa: E731
    table = make(tmp_path / "store")
    train(table, 0, 100)
    table.checkpoint(tmp_path / "first")
    train(table, 1, 200)
    expected = {
        int(key): row for ids, rows in table.store.iter_rows(with_state=True) for key, row in zip(ids, rows)
    }
    table.close()
    export(
        tmp_path / "store", tmp_path / "delta.pt", ".pt", "--since", str(tmp_path / "first"), "--with-state"
    )
    delta = torch.load(tmp_path / "delta.pt")
    assert delta["weight"].shape[1] == 8 and delta["removed_ids"].numel() == 0
    assert 0 < len(delta["ids"]) < len(expected)
    replica = make(tmp_path / "replica")
    replica.restore(tmp_path / "first")
    replica.close()
    apply(tmp_path / "replica", tmp_path / "delta.pt", ".pt")
    replica = make(tmp_path / "replica")
    rows = {
        int(key): row for ids, rows in replica.store.iter_rows(with_state=True) for key, row in zip(ids, rows)
    }
    assert rows.keys() == expected.keys() and all(torch.equal(rows[key], expected[key]) for key in rows)
    replica.close()


def test_nothing_changed_gives_an_empty_delta(tmp_path):
    table = TieredEmbeddingBag(None, 4, path=tmp_path / "store", host_cache=20 * 200)
    train(table, 0, 100)
    table.checkpoint(tmp_path / "now")
    table.close()
    export(tmp_path / "store", tmp_path / "delta.pt", ".pt", "--since", str(tmp_path / "now"))
    delta = torch.load(tmp_path / "delta.pt")
    assert delta["weight"].shape == (0, 4) and delta["ids"].numel() == 0 and delta["removed_ids"].numel() == 0


def test_a_collection_tables_delta(tmp_path):
    configs = [
        EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=100, feature_names=["a"]),
        EmbeddingBagConfig(name="b", embedding_dim=4, num_embeddings=100, feature_names=["b"]),
    ]
    collection = TieredEmbeddingBagCollection(configs, tmp_path / "c", optimizer=Adagrad(lr=0.1))

    def step(a_ids, b_ids):
        values = torch.cat([a_ids, b_ids])
        collection(
            KeyedJaggedTensor(["a", "b"], values, lengths=torch.full((8,), 2))
        ).values().sum().backward()

    step(torch.arange(8), torch.arange(8))
    collection.checkpoint(tmp_path / "ckpt")
    step(torch.arange(4, 12), torch.arange(8))  # table a: 4 changed, 4 new; table b: 8 changed
    collection.close()
    export(tmp_path / "c", tmp_path / "a.pt", ".pt", "--since", str(tmp_path / "ckpt"), "--table", "a")
    delta = torch.load(tmp_path / "a.pt")
    assert sorted(delta["ids"].tolist()) == list(range(4, 12)) and delta["removed_ids"].numel() == 0


def test_ids_expired_since_a_checkpoint_are_a_deltas_removed_ids(tmp_path):
    """A table with a ttl: the ids it forgets after a checkpoint leave the replica with the delta."""
    settings = dict(path=tmp_path / "store", optimizer=Adagrad(lr=0.1), host_cache=20 * 200, ttl=2)
    table = TieredEmbeddingBag(None, 4, **settings)
    train(table, 0, 50, steps=1)
    table.flush()
    table.checkpoint(tmp_path / "first")
    held = set(torch.cat([ids for ids, _ in table.store.iter_rows()]).tolist())
    for seed in (1, 2, 3):
        ids = torch.randint(1000, 1100, (16, 3), generator=torch.Generator().manual_seed(seed))
        table(ids).sum().backward()
        table.flush()
    table.close()
    export(tmp_path / "store", tmp_path / "last.pt", ".pt")
    export(tmp_path / "store", tmp_path / "delta.pt", ".pt", "--since", str(tmp_path / "first"))
    removed = set(torch.load(tmp_path / "delta.pt")["removed_ids"].tolist())
    assert removed == held  # every id of the checkpoint went: none trained for three steps
    replica = TieredEmbeddingBag(None, 4, path=tmp_path / "replica", optimizer=Adagrad(lr=0.1))
    replica.restore(tmp_path / "first")
    replica.close()
    apply(tmp_path / "replica", tmp_path / "delta.pt", ".pt")
    export(tmp_path / "replica", tmp_path / "replica.pt", ".pt")
    last, replica_rows = exported(tmp_path / "last.pt", ".pt"), exported(tmp_path / "replica.pt", ".pt")
    assert replica_rows.keys() == last.keys() and all(torch.equal(replica_rows[k], last[k]) for k in last)
