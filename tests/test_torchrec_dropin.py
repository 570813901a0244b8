"""The collection as TorchRec's ``EmbeddingBagCollection``: the API a ported model calls, and
TorchRec's own models built on it. TorchRec's behaviour is the oracle where TorchRec is installed
(``pip install torchrec`` beside fbgemm-gpu-cpu); the tests that need it skip with that reason."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn

from tierstore import EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor, TieredEmbeddingBagCollection, optim

try:
    import torchrec
    from torchrec.models.dlrm import DLRM, DLRM_DCN
except Exception as error:  # noqa: BLE001 - any failure to import means: no TorchRec to compare with
    torchrec, TORCHREC_MISSING = None, f"TorchRec does not import here ({type(error).__name__}: {error})"
else:
    TORCHREC_MISSING = None

needs_torchrec = pytest.mark.skipif(torchrec is None, reason=str(TORCHREC_MISSING))

TABLES = [
    EmbeddingBagConfig(40, 8, name="t1", feature_names=["f1"]),
    EmbeddingBagConfig(30, 8, name="t2", feature_names=["f2", "f3"]),
]


def batches(seed: int, count: int, keys=("f1", "f2", "f3"), size: int = 4):
    """``count`` (dense [size, 4], KJT of ``keys``, labels [size]) batches."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        lengths = torch.from_numpy(rng.integers(0, 3, len(keys) * size))
        values = torch.from_numpy(rng.integers(0, 30, int(lengths.sum())))
        features = KeyedJaggedTensor(list(keys), values, lengths=lengths)
        out.append((torch.from_numpy(rng.random((size, 4)).astype(np.float32)), features, torch.rand(size)))
    return out


def torchrec_collection_and_ours(tables=TABLES):
    """TorchRec's ``EmbeddingBagCollection`` and ours over the same rows (TorchRec's initial ones)."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig as TorchRecConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    torch.manual_seed(0)
    configs = [
        TorchRecConfig(
            num_embeddings=t.num_embeddings,
            embedding_dim=t.embedding_dim,
            name=t.name,
            feature_names=t.feature_names,
        )
        for t in tables
    ]
    theirs = EmbeddingBagCollection(configs)
    ours = TieredEmbeddingBagCollection(configs, optimizer=optim.SGD(lr=0.1))
    for name, bag in theirs.embedding_bags.items():
        ours.embedding_bags[name].load_weights(torch.arange(bag.weight.shape[0]), bag.weight.detach())
    return theirs, ours


def torchrec_features(features: KeyedJaggedTensor):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor as TorchRecKJT

    return TorchRecKJT(keys=features.keys(), values=features.values(), lengths=features.lengths())


@needs_torchrec
@pytest.mark.parametrize("model", ["DLRM", "DLRM_DCN"])
def test_torchrecs_dlrm_trains_on_the_tiered_collection_as_on_its_own(model):
    """TorchRec's DLRM built on the tiered collection (``embedding_bag_configs()``, KeyedTensor out)
    trains as the same DLRM on TorchRec's ``EmbeddingBagCollection`` with torch's SGD: the same
    losses and, after training, the same rows."""
    theirs_ebc, ours_ebc = torchrec_collection_and_ours()
    kind = {"DLRM": DLRM, "DLRM_DCN": DLRM_DCN}[model]
    settings = dict(dense_in_features=4, dense_arch_layer_sizes=[8], over_arch_layer_sizes=[8, 1])
    if model == "DLRM_DCN":
        settings.update(dcn_num_layers=2, dcn_low_rank_dim=4)
    theirs, ours = (
        kind(embedding_bag_collection=theirs_ebc, **settings),
        kind(embedding_bag_collection=ours_ebc, **settings),
    )
    dense = {
        key: value for key, value in theirs.state_dict().items() if "embedding_bag_collection" not in key
    }
    ours.load_state_dict(dense, strict=False)
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1) for model in (theirs, ours)]
    for dense_features, features, labels in batches(1, 5):
        losses = []
        for model_, optimizer, kjt in zip(
            (theirs, ours), optimizers, (torchrec_features(features), features)
        ):
            optimizer.zero_grad()
            loss = nn.functional.binary_cross_entropy_with_logits(
                model_(dense_features, kjt).squeeze(1), labels
            )
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0])
    for name, bag in theirs_ebc.embedding_bags.items():
        rows = ours_ebc.embedding_bags[name].rows(torch.arange(bag.weight.shape[0]))
        torch.testing.assert_close(rows, bag.weight.detach())
    ours_ebc.close()


DISTRIBUTED_MODEL_PARALLEL = """
import os, torch, torch.distributed as dist, tierstore
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29533"))
dist.init_process_group("gloo", rank=0, world_size=1)
from torchrec.datasets.utils import Batch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.models.dlrm import DLRM_DCN, DLRMTrain
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
tables = [tierstore.EmbeddingBagConfig(100, 8, name="t1", feature_names=["f1"]),
          tierstore.EmbeddingBagConfig(50, 8, name="t2", feature_names=["f2"])]
collection = tierstore.TieredEmbeddingBagCollection(tables)
model = DLRM_DCN(embedding_bag_collection=collection, dense_in_features=4, dense_arch_layer_sizes=[8],
                 over_arch_layer_sizes=[8, 1], dcn_num_layers=2, dcn_low_rank_dim=4)
wrapped = DistributedModelParallel(DLRMTrain(model), device=torch.device("cpu"))
features = KeyedJaggedTensor.from_lengths_sync(
    keys=["f1", "f2"], values=torch.arange(6), lengths=torch.ones(6, dtype=torch.int64)
)
before = collection.embedding_bags["t1"].rows(torch.arange(6))
for _ in range(2):
    loss, _ = wrapped(Batch(dense_features=torch.rand(3, 4), sparse_features=features, labels=torch.rand(3)))
    loss.backward()
assert not torch.equal(collection.embedding_bags["t1"].rows(torch.arange(6)), before)
print("trained")
"""


@needs_torchrec
def test_a_single_rank_distributed_model_parallel_wraps_and_trains_dlrm_on_the_collection(tmp_path):
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(DISTRIBUTED_MODEL_PARALLEL)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "PORT": str(29500 + __import__("os").getpid() % 400)},
    )
    assert run.returncode == 0 and "trained" in run.stdout, run.stderr[-3000:]


@needs_torchrec
def test_a_feature_read_by_two_tables_gives_torchrecs_outputs_named_feature_at_table():
    tables = [
        EmbeddingBagConfig(40, 8, name="t1", feature_names=["f1", "shared"]),
        EmbeddingBagConfig(30, 8, name="t2", feature_names=["shared"]),
    ]
    theirs, ours = torchrec_collection_and_ours(tables)
    _, features, _ = batches(2, 1, keys=("f1", "shared"))[0]
    expected, got = theirs(torchrec_features(features)), ours(features)
    assert got.keys() == ["f1", "shared@t1", "shared@t2"] and sorted(got.keys()) == sorted(expected.keys())
    for key in got.keys():
        torch.testing.assert_close(got[key], expected[key])
    got.values().sum().backward()  # each table's rows get their own gradient
    expected.values().sum().backward()
    for name, bag in theirs.embedding_bags.items():
        rows = ours.embedding_bags[name].rows(torch.arange(bag.weight.shape[0]))
        torch.testing.assert_close(rows, bag.weight.detach() - 0.1 * bag.weight.grad)
    ours.close()


@needs_torchrec
def test_keyed_tensor_methods_give_torchrecs_results():
    from torchrec.sparse.jagged_tensor import KeyedTensor as TorchRecKeyedTensor

    values = torch.arange(24, dtype=torch.float32).reshape(2, 12)
    ours = KeyedTensor(["a", "b", "c"], [3, 4, 5], values)
    theirs = TorchRecKeyedTensor(["a", "b", "c"], [3, 4, 5], values)
    assert (
        ours.offset_per_key() == theirs.offset_per_key() and ours.length_per_key() == theirs.length_per_key()
    )
    assert ours.key_dim() == theirs.key_dim() and ours.device() == theirs.device()
    assert ours.size_in_bytes() == theirs.size_in_bytes()
    for key in "abc":
        assert torch.equal(ours[key], theirs[key])
    other = KeyedTensor(["d"], [2], torch.ones(2, 2))
    other_theirs = TorchRecKeyedTensor(["d"], [2], torch.ones(2, 2))
    groups = [["c", "a"], ["d", "b"]]
    for got, expected in zip(
        KeyedTensor.regroup([ours, other], groups),
        TorchRecKeyedTensor.regroup([theirs, other_theirs], groups),
    ):
        assert torch.equal(got, expected)
    as_dict = KeyedTensor.regroup_as_dict([ours, other], groups, ["x", "y"])
    expected_dict = TorchRecKeyedTensor.regroup_as_dict([theirs, other_theirs], groups, ["x", "y"])
    assert as_dict.keys() == expected_dict.keys() and all(
        torch.equal(as_dict[k], expected_dict[k]) for k in as_dict
    )
    built = KeyedTensor.from_tensor_list(["p", "q"], [torch.ones(2, 3), torch.zeros(2, 1)])
    built_theirs = TorchRecKeyedTensor.from_tensor_list(["p", "q"], [torch.ones(2, 3), torch.zeros(2, 1)])
    assert built.length_per_key() == built_theirs.length_per_key() and torch.equal(
        built.values(), built_theirs.values()
    )
    assert torch.equal(ours.to("cpu").values(), theirs.to(torch.device("cpu")).values())


def test_keyed_tensor_methods_as_torchrec_documents_them():
    """The same methods, their results written out (where TorchRec is not installed too)."""
    values = torch.arange(24, dtype=torch.float32).reshape(2, 12)
    keyed = KeyedTensor(["a", "b", "c"], [3, 4, 5], values)
    assert keyed.offset_per_key() == [0, 3, 7, 12] and keyed.key_dim() == 1 and keyed.size_in_bytes() == 96
    assert torch.equal(keyed["b"], values[:, 3:7]) and torch.equal(keyed.to_dict()["c"], values[:, 7:])
    regrouped = KeyedTensor.regroup([keyed], [["c", "a"], ["b"]])
    assert torch.equal(regrouped[0], torch.cat([values[:, 7:], values[:, :3]], dim=1))
    with pytest.raises(KeyError, match="'z'"):
        KeyedTensor.regroup([keyed], [["z"]])


def test_the_collection_answers_torchrecs_module_api():
    collection = TieredEmbeddingBagCollection(TABLES, is_weighted=True)
    assert collection.embedding_bag_configs() == TABLES and collection.is_weighted()
    assert collection.device == torch.device("cpu")
    table = collection.embedding_bags["t2"]
    assert (table.num_embeddings, table.embedding_dim, table.feature_names) == (30, 8, ["f2", "f3"])
    table.load_weights(torch.tensor([3]), torch.full((1, 8), 2.0))
    assert torch.equal(table.rows(torch.tensor([3])), torch.full((1, 8), 2.0))
    with pytest.raises(AttributeError, match="rows\\(ids\\)"):
        table.weight  # noqa: B018 - the access is the test
    features = KeyedJaggedTensor(
        ["f2"], torch.tensor([3, 3]), lengths=torch.tensor([2]), weights=torch.tensor([0.5, 2.0])
    )
    assert torch.equal(collection(features).values(), torch.full((1, 8), 5.0))  # weighted: 2 * (0.5 + 2)
    unweighted = TieredEmbeddingBagCollection(TABLES)  # TorchRec's default: weights ignored
    unweighted.embedding_bags["t2"].load_weights(torch.tensor([3]), torch.full((1, 8), 2.0))
    assert not unweighted.is_weighted() and torch.equal(
        unweighted(features).values(), torch.full((1, 8), 4.0)
    )
    for each in (collection, unweighted):
        each.close()


def test_a_schedule_drives_the_collections_fused_optimizer():
    collection = TieredEmbeddingBagCollection(
        [*TABLES, EmbeddingBagConfig(10, 4, name="t3", feature_names=["g"])], optimizer=optim.SGD(lr=1.0)
    )
    fused = collection.fused_optimizer()
    assert (
        isinstance(fused, torch.optim.Optimizer) and len(fused.param_groups) == 2
    )  # one per group of tables
    schedule = torch.optim.lr_scheduler.LambdaLR(fused, lambda step: 0.5**step)
    features = KeyedJaggedTensor(["f1"], torch.tensor([5]), lengths=torch.tensor([1]))
    before = collection.embedding_bags["t1"].rows(torch.tensor([5]))
    for _ in range(3):
        collection(features).values().sum().backward()
        schedule.step()
    after = collection.embedding_bags["t1"].rows(torch.tensor([5]))
    torch.testing.assert_close(after, before - (1.0 + 0.5 + 0.25))  # each step's gradient is 1
    assert [group.optimizer.lr for group in collection.groups.values()] == [0.125, 0.125]
    collection.close()


@pytest.mark.parametrize(
    "field, value", [("weight_init_max", 0.1), ("init_fn", print), ("need_pos", True), ("data_type", "INT8")]
)
def test_torchrecs_config_fields_a_tiered_table_cannot_honour_are_refused_by_name(field, value):
    config = EmbeddingBagConfig(10, 4, name="t", feature_names=["f"], **{field: value})
    with pytest.raises(ValueError, match=f"table 't': {field}"):
        TieredEmbeddingBagCollection([config])
