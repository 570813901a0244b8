"""The cuda device-cache backend on a real GPU against the torch backend (skipped without one)."""

import numpy as np
import pytest
import torch
from torch import nn

from tierstore import TieredEmbeddingBag, TieredStore, initial_weights, optim
from tierstore.kernels import CudaError, device_kernels

pytestmark = pytest.mark.gpu


def test_auto_picks_the_kernels_on_a_gpu(tmp_path):
    with TieredStore(tmp_path / "s", dim=8, host_cache=64, device_cache=16, device="cuda") as store:
        assert store.stats()["device"]["backend"] == "cuda"


def test_cuda_backend_matches_torch_backend_on_random_workloads(tmp_path):
    rng = np.random.default_rng(0)
    stores = {
        name: TieredStore(
            tmp_path / name, dim=12, host_cache=40, device_cache=24, device="cuda", device_cache_backend=name
        )
        for name in ("cuda", "torch")
    }
    oracle = {}
    for step in range(300):
        ids = torch.from_numpy(rng.integers(0, 200, rng.integers(1, 24)))  # repeats within a batch
        if step % 3 == 0:
            rows = torch.from_numpy(rng.standard_normal((ids.numel(), 12)).astype(np.float32))
            for store in stores.values():
                store.put(ids, rows)
            oracle.update(zip(ids.tolist(), rows))  # the last repeat wins
        got = {name: store.get(ids) for name, store in stores.items()}
        assert torch.equal(got["cuda"], got["torch"]), step
        for id_, row in zip(ids.tolist(), got["cuda"].cpu()):
            if id_ in oracle:
                assert torch.equal(row, oracle[id_])
        if step % 50 == 49:
            for store in stores.values():
                store.flush()
    for store in stores.values():
        assert store.stats()["device"]["evictions"] > 0
        store.close()


@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise", "adam"])
def test_training_on_the_gpu_matches_the_torch_backend_and_torch(name, tmp_path):
    make = {
        "sgd": lambda: optim.SGD(lr=0.1),
        "adagrad": lambda: optim.Adagrad(lr=0.1),
        "rowwise": lambda: optim.RowWiseAdagrad(lr=0.1),
        "adam": lambda: optim.Adam(lr=0.05),
    }[name]
    tables = {
        backend: TieredEmbeddingBag(
            64,
            8,
            mode="sum",
            path=tmp_path / backend,
            host_cache=12,
            device_cache=24,
            optimizer=make(),
            device="cuda",
            device_cache_backend=backend,
        )
        for backend in ("cuda", "torch")
    }
    reference = nn.EmbeddingBag(64, 8, mode="sum", sparse=True).cuda()
    with torch.no_grad():
        reference.weight.copy_(initial_weights(torch.arange(64), 8, 0, torch.float32))
    reference_optimizer = {
        "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
        "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
        "adam": lambda p: torch.optim.SparseAdam(p, lr=0.05),
    }.get(name, lambda p: None)(reference.parameters())
    rng = np.random.default_rng(1)
    for _ in range(50):
        lengths = rng.integers(0, 5, 6)
        ids = torch.from_numpy(rng.integers(0, 64, int(lengths.sum()))).cuda()
        offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)[:-1]])).cuda()
        target = torch.from_numpy(rng.standard_normal((6, 8)).astype(np.float32)).cuda()
        for table in tables.values():
            (table(ids, offsets) * target).sum().backward()
        if reference_optimizer is not None:
            reference_optimizer.zero_grad()
            (reference(ids, offsets) * target).sum().backward()
            reference_optimizer.step()
    rows = {}
    for backend, table in tables.items():
        table.close()
        with TieredStore(tmp_path / backend, read_only=True, host_cache=64) as reopened:
            rows[backend] = reopened.get(torch.arange(64), with_state=True)
    torch.testing.assert_close(rows["cuda"], rows["torch"], rtol=1e-5, atol=1e-6)
    if reference_optimizer is not None:
        torch.testing.assert_close(rows["cuda"][:, :8], reference.weight.detach().cpu(), rtol=1e-5, atol=1e-6)


def test_a_launch_with_a_tensor_on_another_device_names_the_kernel():
    kernels, why_not = device_kernels(torch.device("cuda"))
    assert kernels is not None, why_not
    with pytest.raises(CudaError, match="cache_find"):
        kernels.launch(
            "cache_find",
            4,
            torch.zeros(4, dtype=torch.int64),
            torch.zeros(4, dtype=torch.int32),
            3,
            torch.zeros(4, dtype=torch.int64),
            4,
            torch.zeros(4, dtype=torch.int32),
        )
