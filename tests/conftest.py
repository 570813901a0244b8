import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["lmdb", "mmap"])
def backend(request):
    return request.param


@pytest.fixture
def store_path(tmp_path):
    return tmp_path / "store"
