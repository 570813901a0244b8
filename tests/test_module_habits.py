"""The tiered modules behave as nn.Modules do: tracing and scripting refuse clearly, compile,
pickling and torch.save, deepcopy, dtype casts, numpy integers, temporary stores."""

import copy
import gc
import io
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn

from tierstore import (
    EmbeddingBagConfig,
    KeyedJaggedTensor,
    TieredEmbedding,
    TieredEmbeddingBag,
    TieredEmbeddingBagCollection,
    TieredStore,
    optim,
)

NUM, DIM = 64, 8


def bag(path=None, **settings):
    settings = {"host_cache": 16, "optimizer": optim.Adagrad(lr=0.1), "mode": "sum"} | settings
    return TieredEmbeddingBag(NUM, DIM, path=path, **settings)


def batch(seed):
    rng = np.random.default_rng(seed)
    ids = torch.from_numpy(rng.integers(0, NUM, 12))
    return ids, torch.tensor([0, 3, 3, 7]), torch.from_numpy(rng.standard_normal((4, DIM)).astype(np.float32))


def train(table, steps, first_seed=0):
    for seed in range(first_seed, first_seed + steps):
        ids, offsets, target = batch(seed)
        (table(ids, offsets) * target).sum().backward()


def rows_of(table):
    return table.store.get(torch.arange(NUM), with_state=True, grow=False)


# -- tracing and scripting -------------------------------------------------------------------------


@pytest.mark.parametrize("make", [bag, lambda: TieredEmbedding(NUM, DIM, host_cache=16)])
def test_jit_trace_refuses_clearly_instead_of_crashing(make):
    table = make()
    ids = torch.tensor([[1, 2], [3, 4]])
    with pytest.raises(RuntimeError, match=r"torch.jit.trace cannot record .*torch.compile"):
        torch.jit.trace(table, (ids,))
    table(ids)  # still works after the refusal
    table.close()


@pytest.mark.parametrize("host_backend", ["torch", "openmp"])
def test_jit_trace_of_a_model_ends_in_an_error_never_a_signal(host_backend):
    """The crash reported (an INTERNAL ASSERT, then SIGSEGV in a kernel launch with the torch host
    backend) would kill the process: tracing runs in a subprocess, which must exit with the error."""
    script = textwrap.dedent(
        f"""
        import torch, tierstore
        table = tierstore.TieredEmbeddingBag(
            None, 4, mode="sum", host_cache=8, host_cache_backend="{host_backend}"
        )
        model = torch.nn.Sequential(table)
        try:
            torch.jit.trace(model, (torch.tensor([[1, 2], [3, 4]]),))
        except RuntimeError as error:
            print("refused:", str(error).splitlines()[0])
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.startswith("refused: torch.jit.trace cannot record a TieredEmbeddingBag")


def test_jit_script_refuses_clearly():
    table = bag()
    with pytest.raises(RuntimeError, match=r"torch.jit.script cannot compile .*torch.compile"):
        torch.jit.script(nn.Sequential(table))
    table.close()


# -- torch.compile ---------------------------------------------------------------------------------


class SmallModel(nn.Module):
    """A tiered table under dense layers, as in a recommendation model."""

    def __init__(self, path, backend):
        super().__init__()
        self.table = bag(path, backend=backend, host_cache=24)
        self.top = nn.Linear(DIM, 1)

    def forward(self, ids, offsets):
        return self.top(torch.relu(self.table(ids, offsets))).squeeze(1)


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize("backend", ["lmdb", "mmap"])
def test_a_compiled_model_trains_as_the_eager_one(tmp_path, compiler, backend):
    """The table's forward is opaque to the compiler (a graph break); the dense layers compile.
    aot_eager runs the same kernels as eager, so rows match exactly; inductor fuses the dense
    layers' float arithmetic differently, so within float32 rounding."""
    torch.manual_seed(0)
    eager, compiled = SmallModel(tmp_path / "eager", backend), SmallModel(tmp_path / "compiled", backend)
    compiled.top.load_state_dict(eager.top.state_dict())
    models = {"eager": eager, "compiled": torch.compile(compiled, backend=compiler)}
    optimizers = {name: torch.optim.SGD(model.parameters(), lr=0.1) for name, model in models.items()}
    rng = np.random.default_rng(0)
    for _ in range(6):
        ids, offsets = torch.from_numpy(rng.integers(0, NUM, 20)), torch.tensor([0, 5, 9, 14])
        target = torch.rand(4)
        losses = {}
        for name, model in models.items():
            loss = ((model(ids, offsets) - target) ** 2).mean()
            optimizers[name].zero_grad()
            loss.backward()
            optimizers[name].step()
            losses[name] = loss.detach()
        exact = compiler == "aot_eager"
        torch.testing.assert_close(
            losses["compiled"], losses["eager"], **({"rtol": 0, "atol": 0} if exact else {})
        )
    tolerance = {"rtol": 0, "atol": 0} if compiler == "aot_eager" else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(rows_of(compiled.table), rows_of(eager.table), **tolerance)
    assert compiled.table.step == eager.table.step == 6
    eager.table.close()
    compiled.table.close()


class ModelOfEveryKind(nn.Module):
    """A bag, an embedding and a collection beside dense layers, as a model traced by torch.fx."""

    def __init__(self, directory):
        super().__init__()
        self.bag = TieredEmbeddingBag(NUM, DIM, mode="sum", path=directory / "bag", host_cache=16)
        self.embedding = TieredEmbedding(NUM, DIM, path=directory / "embedding", host_cache=16)
        config = EmbeddingBagConfig(NUM, DIM, name="t", feature_names=["f"])
        self.collection = TieredEmbeddingBagCollection([config], path=directory / "collection", host_cache=16)
        self.top = nn.Linear(3 * DIM, 1)

    def forward(self, ids, offsets, features):
        pooled = self.collection(features).values()
        return self.top(torch.cat([self.bag(ids, offsets), self.embedding(ids[:2]), pooled], dim=1))


def test_torch_fx_traces_a_model_with_tiered_modules_as_leaves_and_it_trains_as_the_eager_one(tmp_path):
    """``torch.fx.symbolic_trace`` (and tracers built on it, as TorchRec's) sees each tiered module
    as one call, so the rest of the model traces; the traced module trains as the eager one."""
    torch.manual_seed(0)
    eager, traced = ModelOfEveryKind(tmp_path / "eager"), ModelOfEveryKind(tmp_path / "traced")
    traced.top.load_state_dict(eager.top.state_dict())
    graph_module = torch.fx.symbolic_trace(traced)
    called = {node.target for node in graph_module.graph.nodes if node.op == "call_module"}
    assert {"bag", "embedding", "collection", "top"} <= called
    rng = np.random.default_rng(1)
    for _ in range(3):
        ids, offsets = torch.from_numpy(rng.integers(0, NUM, 4)), torch.tensor([0, 3])
        features = KeyedJaggedTensor(
            ["f"], torch.from_numpy(rng.integers(0, NUM, 3)), lengths=torch.tensor([1, 2])
        )
        outputs = [model(ids, offsets, features) for model in (eager, graph_module)]
        assert torch.equal(outputs[0], outputs[1])
        for output in outputs:
            output.sum().backward()
    for name in ("bag", "embedding"):
        assert torch.equal(rows_of(getattr(traced, name)), rows_of(getattr(eager, name)))
    keys = torch.arange(NUM)
    assert torch.equal(
        traced.collection.groups[f"dim{DIM}"].store.get(keys),
        eager.collection.groups[f"dim{DIM}"].store.get(keys),
    )
    for model in (eager, traced):
        for table in (model.bag, model.embedding, model.collection):
            table.close()


def test_tables_load_no_compiler_until_one_is_used_and_stay_opaque_to_it(tmp_path):
    """``import tierstore`` and training do not load torch._dynamo (about 70 MiB of memory); a
    model built before the user compiles it still keeps the table out of the graph (only the dense
    layers' ops reach the compiler's backend) and trains as its eager twin does. In a fresh
    interpreter: pytest's process may have loaded the compiler already."""
    script = textwrap.dedent(
        f"""
        import sys
        import torch
        from torch import nn
        from tierstore import TieredEmbeddingBag
        class Model(nn.Module):
            def __init__(self, path):
                super().__init__()
                self.table = TieredEmbeddingBag(50, 4, mode="sum", path=path, host_cache=24)
                self.top = nn.Linear(4, 1)
            def forward(self, ids, offsets):
                return self.top(torch.relu(self.table(ids, offsets))).squeeze(1)
        torch.manual_seed(0)
        eager, compiled = Model({str(tmp_path / "eager")!r}), Model({str(tmp_path / "compiled")!r})
        compiled.top.load_state_dict(eager.top.state_dict())
        ids, offsets = torch.tensor([1, 2, 3, 4, 5, 1]), torch.tensor([0, 2, 5])
        for model in (eager, compiled):
            model(ids, offsets).sum().backward()
        assert "torch._dynamo" not in sys.modules, "training loaded the compiler"
        graphs = []
        def backend(graph, inputs):
            graphs.append([str(node.target) for node in graph.graph.nodes if node.op.startswith("call")])
            return graph.forward
        models = {{"eager": eager, "compiled": torch.compile(compiled, backend=backend)}}
        for _ in range(3):
            for model in models.values():
                model(ids, offsets).sum().backward()
        assert graphs and all(len(ops) == 3 for ops in graphs), graphs  # relu, linear, squeeze
        everything = torch.arange(50)
        assert torch.equal(compiled.table.store.get(everything), eager.table.store.get(everything))
        print("ok")
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]


def test_training_and_state_dicts_load_neither_torch_distributed_nor_sympy(tmp_path):
    """``torch.distributed.checkpoint`` (with the sympy it imports: tens of MiB of a process's
    memory, README "Larger than RAM") is loaded only where ``dcp`` saves or loads a table: a process
    under a memory limit keeps that memory for its caches. In a fresh interpreter."""
    script = textwrap.dedent(
        f"""
        import sys
        import torch
        from tierstore import TieredEmbeddingBag
        table = TieredEmbeddingBag(50, 4, mode="sum", path={str(tmp_path / "t")!r}, host_cache=24)
        table(torch.tensor([1, 2, 3]), torch.tensor([0])).sum().backward()
        table.load_state_dict(table.state_dict())
        table.close()
        loaded = [name for name in ("torch.distributed.checkpoint", "sympy") if name in sys.modules]
        assert not loaded, loaded
        print("ok")
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


# -- pickling, torch.save, deepcopy ----------------------------------------------------------------


def test_pickling_flushes_and_unpickling_reopens_the_same_store(tmp_path):
    table = bag(tmp_path / "t", mode="mean", missing="zero", seed=3)
    train(table, 5)
    blob = pickle.dumps(table)
    expected = rows_of(table)
    table.close()
    reopened = pickle.loads(blob)
    assert reopened.store.path == (tmp_path / "t").resolve()
    assert (reopened.mode, reopened.missing, reopened.step) == ("mean", "zero", 5)
    assert isinstance(reopened.optimizer, optim.Adagrad) and reopened.optimizer.lr == 0.1
    torch.testing.assert_close(rows_of(reopened), expected, rtol=0, atol=0)
    reopened.close()


def test_torch_save_of_a_model_holding_a_table_loads_and_trains_on(tmp_path):
    model = nn.Sequential(bag(tmp_path / "t"))
    train(model[0], 3)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    model[0].close()
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    train(loaded[0], 3, first_seed=3)
    reference = bag(tmp_path / "r")
    train(reference, 6)
    torch.testing.assert_close(rows_of(loaded[0]), rows_of(reference), rtol=0, atol=0)
    loaded[0].close()
    reference.close()


def test_a_temporary_store_cannot_be_pickled_by_reference():
    table = bag()
    with pytest.raises(pickle.PicklingError, match=r"temporary store .* path="):
        pickle.dumps(table)
    table.close()


@pytest.mark.parametrize("with_path", [True, False])
def test_deepcopy_is_an_independent_table_holding_the_rows_as_of_now(tmp_path, with_path):
    table = bag(tmp_path / "t" if with_path else None)
    train(table, 4)
    twin = copy.deepcopy(table)
    assert twin.store.path != table.store.path
    torch.testing.assert_close(rows_of(twin), rows_of(table), rtol=0, atol=0)
    assert twin.step == table.step
    train(table, 2, first_seed=10)  # only the original moves
    assert not torch.equal(rows_of(twin), rows_of(table))
    train(twin, 2, first_seed=10)  # and the copy trains the same way from the same rows
    torch.testing.assert_close(rows_of(twin), rows_of(table), rtol=0, atol=0)
    twin_path = twin.store.path
    twin.close()
    table.close()
    assert not twin_path.exists()  # the copy lives in a temporary store


# -- dtype casts -----------------------------------------------------------------------------------


@pytest.mark.parametrize("cast", ["double", "half", "to"])
def test_a_dtype_cast_casts_the_outputs_and_training_goes_on(cast):
    model = nn.Sequential(bag(), nn.Linear(DIM, 1))
    model = {"double": model.double, "half": model.half, "to": lambda: model.to(torch.float64)}[cast]()
    dtype = torch.float16 if cast == "half" else torch.float64
    ids, offsets, _ = batch(0)
    out = model[0](ids, offsets)
    assert out.dtype == dtype
    before = rows_of(model[0])
    if dtype == torch.float64:  # half matmuls are not on every CPU build
        model[1](model[0](ids, offsets)).sum().backward()
        assert not torch.equal(rows_of(model[0]), before)
    assert model[0].store.dtype == torch.float32  # the rows stay as stored
    weights = torch.rand(ids.numel(), dtype=dtype)
    assert model[0](ids, offsets, weights).dtype == dtype  # weights of the output dtype are taken
    model[0].close()


# -- numpy integers and 0-d tensors ----------------------------------------------------------------


@pytest.mark.parametrize("integer", [np.int64, np.int32, np.uint16, lambda n: torch.tensor(n)])
def test_numpy_integers_and_0d_tensors_are_taken_for_sizes_and_budgets(integer):
    table = TieredEmbeddingBag(
        integer(NUM), integer(DIM), mode="sum", padding_idx=integer(0), host_cache=integer(16)
    )
    assert (table.num_embeddings, table.embedding_dim, table.padding_idx) == (NUM, DIM, 0)
    assert type(table.num_embeddings) is int
    assert table.store.stats()["host"]["capacity_rows"] == 16
    table.close()
    with TieredStore(None, dim=integer(4), host_cache=integer(8)) as store:
        assert store.stats()["host"]["capacity_rows"] == 8


@pytest.mark.parametrize("bad", [np.float64(3), torch.tensor(3.0), torch.tensor([3]), np.bool_(True)])
def test_non_integral_sizes_are_refused_by_name(bad):
    with pytest.raises((TypeError, ValueError), match="num_embeddings"):
        TieredEmbeddingBag(bad, DIM)
    with pytest.raises((TypeError, ValueError), match="host_cache"):
        TieredEmbeddingBag(NUM, DIM, host_cache=bad)


# -- temporary stores and the default tiers ---------------------------------------------------------


def test_a_temporary_store_is_deleted_when_its_module_is_collected():
    table = bag()
    train(table, 2)
    path = table.store.path
    assert path.exists()
    del table
    gc.collect()
    assert not path.exists()


def test_a_temporary_store_is_deleted_at_interpreter_exit(tmp_path):
    script = textwrap.dedent(
        """
        import sys, torch, tierstore
        table = tierstore.TieredEmbeddingBag(None, 4, mode="sum", host_cache=8)
        table(torch.tensor([[1, 2]])).sum().backward()
        print(table.store.path)
        sys.stdout.flush()
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    from pathlib import Path

    path = Path(done.stdout.strip())
    assert path.name and not path.exists()


def test_on_a_cpu_device_there_is_no_device_tier_by_default():
    table = bag()
    assert "device" not in table.store.stats()
    table.close()
    with TieredStore(None, dim=4) as store:
        assert "device" not in store.stats()
    with TieredStore(None, dim=4, device_cache=8) as store:  # asked for: given
        assert store.stats()["device"]["capacity_rows"] == 8


# -- loading weights -------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["lmdb", "mmap"])
def test_from_pretrained_holds_the_weights_and_trains_as_torch_when_not_frozen(tmp_path, backend):
    weights = torch.randn(1000, DIM)  # far more rows than the 16-row cache
    frozen = TieredEmbeddingBag.from_pretrained(
        weights, mode="sum", path=tmp_path / "f", backend=backend, host_cache=16
    )
    reference = nn.EmbeddingBag.from_pretrained(weights, mode="sum")
    ids, offsets = torch.tensor([3, 999, 3, 500, 0]), torch.tensor([0, 2])
    torch.testing.assert_close(frozen(ids, offsets), reference(ids, offsets), rtol=0, atol=0)
    (
        frozen(ids, offsets) * torch.ones(2, DIM, requires_grad=True)
    ).sum().backward()  # frozen: rows never change
    assert torch.equal(frozen.store.get(torch.arange(1000), grow=False), weights)
    frozen.close()

    table = TieredEmbeddingBag.from_pretrained(
        weights,
        freeze=False,
        mode="sum",
        path=tmp_path / "t",
        backend=backend,
        host_cache=16,
        optimizer=optim.SGD(lr=0.5),
    )
    trained = nn.EmbeddingBag.from_pretrained(weights.clone(), freeze=False, mode="sum", sparse=True)
    sgd = torch.optim.SGD(trained.parameters(), lr=0.5)
    for seed in range(3):
        ids, offsets, target = batch(seed)
        (table(ids, offsets) * target).sum().backward()
        sgd.zero_grad()
        (trained(ids, offsets) * target).sum().backward()
        sgd.step()
    torch.testing.assert_close(table.store.get(torch.arange(1000), grow=False), trained.weight.detach())
    table.close()


def test_from_pretrained_embedding_and_a_bad_tensor():
    weights = torch.randn(50, 4, dtype=torch.float64)
    table = TieredEmbedding.from_pretrained(weights, host_cache=8)
    assert table.store.dtype == torch.float64
    torch.testing.assert_close(table(torch.tensor([[49, 0]])), weights[[49, 0]][None], rtol=0, atol=0)
    table.close()
    with pytest.raises(ValueError, match="embeddings must be a 2-D tensor"):
        TieredEmbedding.from_pretrained(torch.randn(5))


def test_from_pretrained_with_bad_weights_creates_nothing(tmp_path):
    weights = torch.randn(10, 4)
    weights[7, 1] = float("nan")
    with pytest.raises(ValueError, match="embeddings hold NaN or Inf .first in row 7."):
        TieredEmbedding.from_pretrained(weights, path=tmp_path / "t")
    with pytest.raises(TypeError, match="embeddings"):
        TieredEmbedding.from_pretrained(torch.randn(10, 4), dtype=torch.float64, path=tmp_path / "t")
    assert not (tmp_path / "t").exists()


def test_load_weights_replaces_cached_rows_keeps_optimizer_state_and_checks_first(tmp_path):
    table = bag(tmp_path / "t")  # Adagrad: rows carry state
    train(table, 4)
    before = rows_of(table)  # every row now cached or stored, some with state
    ids = torch.tensor([5, 7, 5, 63])
    new = torch.arange(4 * DIM, dtype=torch.float32).reshape(4, DIM)
    with pytest.raises(ValueError, match="rows"):
        table.load_weights(ids, new[:, :3])  # wrong width: refused, nothing changes
    with pytest.raises(IndexError):
        table.load_weights(torch.tensor([64]), new[:1])  # past num_embeddings
    assert torch.equal(rows_of(table), before)
    table.load_weights(ids, new)
    after = rows_of(table)
    expected = before.clone()
    expected[[7, 5, 63], :DIM] = new[[1, 2, 3]]  # the last repeat of 5 wins
    assert torch.equal(after, expected)  # weights replaced, Adagrad state kept
    table.close()
    with TieredStore(tmp_path / "t", read_only=True, host_cache=NUM) as reopened:  # durable
        assert torch.equal(reopened.get(torch.arange(NUM), with_state=True), expected)


def test_a_store_load_larger_than_the_caches_is_one_call(tmp_path):
    with TieredStore(tmp_path / "s", dim=4, host_cache=8, backend="mmap") as store:
        store.get(torch.arange(6))  # some ids held (put path), most new (bulk path)
        rows = torch.randn(5000, 4)
        store.load(torch.arange(5000), rows, chunk_rows=1024)
        assert len(store) == 5000 and torch.equal(store.get(torch.arange(5000)), rows)
    with pytest.raises(Exception, match="read_only"):
        TieredStore(tmp_path / "s", read_only=True, host_cache=8).load([0], torch.zeros(1, 4))


@pytest.mark.parametrize("backend", ["lmdb", "mmap"])
def test_a_state_dict_loads_into_another_store_while_its_own_is_open(tmp_path, backend):
    first = bag(tmp_path / "a", backend=backend)
    train(first, 3)
    second = bag(tmp_path / "b", backend=backend, host_cache=4)  # fewer cached rows than the table holds
    second.load_state_dict(first.state_dict())  # LMDB: read through the environment already open
    assert second.step == 3 and len(second.store) == len(first.store)
    assert torch.equal(rows_of(second), rows_of(first))
    first.close()
    second.close()


def test_the_default_cold_store_is_the_mmap_backend(tmp_path):
    table = TieredEmbeddingBag(None, 4, path=tmp_path / "t", host_cache=8)
    assert table.store.metadata.backend == "mmap" and table.store.stats()["cold"]["backend"] == "mmap"
    table.close()


def test_a_table_pickled_before_its_freezing_switch_existed_loads_frozen_as_it_was(tmp_path):
    """Pickles of an earlier version hold a ``frozen`` flag and no ``trainable`` parameter."""
    for frozen in (True, False):
        table = TieredEmbeddingBag(NUM, DIM, mode="sum", path=tmp_path / f"t{frozen}", host_cache=16)
        state = dict(table.__dict__)
        state["_parameters"] = {}  # as an earlier version pickled it
        state["frozen"] = frozen
        table.__setstate__(state)
        assert table.frozen == frozen and table.trainable.numel() == 0
        assert table(torch.tensor([[1, 2]])).requires_grad != frozen
        table.close()


def test_a_table_with_its_fused_optimizer_made_pickles_without_it(tmp_path):
    table = TieredEmbeddingBag(NUM, DIM, mode="sum", path=tmp_path / "t", host_cache=16)
    fused = table.fused_optimizer()
    fused.param_groups[0]["lr"] = 0.5
    blob = pickle.dumps(table)
    table.close()  # one writer at a time: the pickle reopens the store
    loaded = pickle.loads(blob)
    assert "_fused_optimizer" not in loaded.__dict__ and loaded.optimizer.lr == 0.5
    assert loaded.fused_optimizer()._tables == [loaded]
    loaded.close()
