"""The kernels on float16 and bfloat16 rows (both host builds, and a GPU's where there is one):
conversions bit for bit as torch's, stochastic rounding bit for bit as
``tierstore.rounding``, row moves as torch's indexing, and every optimizer's update as the torch
backend's (float32 arithmetic, one rounding)."""

import pytest
import torch
from helpers import KERNEL_OPTIMIZERS
from host_kernels import parallel_host_kernels, shared_host_kernels

from tierstore import optim
from tierstore.kernels import device_kernels
from tierstore.metadata import row_width, state_of
from tierstore.rounding import stochastically_rounded
from tierstore.tiers.backends import KernelRows, TorchRows

DTYPES = [torch.float16, torch.bfloat16]
ULP = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


@pytest.fixture(params=["one-thread-gpu-loops", "openmp", pytest.param("gpu", marks=pytest.mark.gpu)])
def build(request):
    """``(kernels, the device their tensors live on)``: both host builds, and the GPU's."""
    if request.param == "gpu":
        kernels, why_not = device_kernels(torch.device("cuda"), torch.float16)
        assert kernels is not None, why_not
        return KernelRows(kernels, "cuda"), torch.device("cuda")
    kernels = shared_host_kernels() if request.param == "one-thread-gpu-loops" else parallel_host_kernels()
    return KernelRows(kernels, "host"), torch.device("cpu")


def float32_values(dtype, count=200_000):
    """Random float32 bit patterns (no NaN) and the cases a rounding gets wrong: ties, the largest
    finite value and the overflow threshold, subnormals and their boundary, zeros and infinities."""
    bits = torch.randint(-(2**31), 2**31, (count,), generator=torch.Generator().manual_seed(5))
    values = bits.to(torch.int32).view(torch.float32)
    values = values[~torch.isnan(values)]
    info = torch.finfo(dtype)
    edges = torch.tensor(
        [0.0, -0.0, float("inf"), float("-inf"), info.max, 65519.996, 65520.0, 65536.0, info.tiny],
        dtype=torch.float32,
    )
    scaled = torch.linspace(-4, 4, 20_001)  # steps of 4e-4: many ties of both dtypes' spacings
    tiny = torch.arange(-4096, 4097, dtype=torch.float32) * 2.0**-26  # around float16's subnormals
    return torch.cat([values, edges, -edges, scaled, tiny, tiny * 2.0**-100, values * 2.0**-120])


def rounded_by_sgd(build, values, dtype, stochastic=False, step=1):
    """``values`` rounded to ``dtype`` by the SGD kernel: rows of -0.0 minus (1.0 x -values) are the
    values exactly (as float32), rounded once. Returns them on the CPU, with the values as rows and
    the rows' ids."""
    backend, device = build
    columns = 64
    padded = torch.cat([values, values.new_zeros(-values.numel() % columns)]).reshape(-1, columns)
    rows = torch.full(padded.shape, -0.0, dtype=dtype, device=device)
    slots = torch.arange(rows.shape[0], device=device)
    keys = torch.arange(rows.shape[0]) * 7 + 3
    optimizer = optim.SGD(lr=1.0, stochastic_rounding=stochastic)
    backend.optimizer_step(optimizer, rows, slots, -padded, step, keys)
    return rows.cpu().reshape(-1)[: values.numel()], padded, keys


@pytest.mark.parametrize("dtype", DTYPES)
def test_rounding_to_nearest_is_torchs_bit_for_bit(build, dtype):
    values = float32_values(dtype)
    rounded, _, _ = rounded_by_sgd(build, values, dtype)
    assert torch.equal(rounded.view(torch.int16), values.to(dtype).view(torch.int16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_16_bit_value_widens_and_rounds_back_to_itself(build, dtype):
    backend, device = build
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype).reshape(-1, 64)
    rows = every.to(device)
    zero = torch.zeros(rows.shape, dtype=torch.float32)
    backend.optimizer_step(optim.SGD(lr=1.0), rows, torch.arange(rows.shape[0], device=device), zero, 1)
    rows, nan = rows.cpu(), torch.isnan(every)
    assert torch.equal(rows[~nan].view(torch.int16), every[~nan].view(torch.int16))
    assert bool(torch.isnan(rows[nan]).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_stochastic_rounding_is_the_torch_references_bit_for_bit(build, dtype):
    values = float32_values(dtype, count=50_000)
    rounded, padded, keys = rounded_by_sgd(build, values, dtype, stochastic=True, step=11)
    expected = stochastically_rounded(padded, dtype, keys, 11).reshape(-1)[: values.numel()]
    assert torch.equal(rounded.view(torch.int16), expected.view(torch.int16))
    assert not torch.equal(rounded, values.to(dtype))  # not rounding to nearest


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [5, 8])
def test_16_bit_gather_and_scatter_move_the_bits(build, dtype, width):
    """Even widths move as float32 pairs (vectorised), odd ones as 16-bit values: every bit
    pattern survives, NaNs' too."""
    backend, device = build
    generator = torch.Generator().manual_seed(4)
    bits = torch.randint(-(2**15), 2**15, (40, width), generator=generator).to(torch.int16)
    rows = bits.view(dtype).to(device)
    slots = torch.tensor([7, 3, 3, 39, 0])
    for columns in {width, width - 1, 4}:
        gathered = backend.gather(rows, slots.to(device), columns, None).cpu()
        assert torch.equal(gathered.view(torch.int16), bits[slots, :columns])
    values = torch.randint(-(2**15), 2**15, (3, width), generator=generator).to(torch.int16)
    distinct = torch.tensor([4, 30, 9])
    backend.scatter(rows, distinct.to(device), values.view(dtype).to(device), width)
    assert torch.equal(rows.cpu().view(torch.int16), bits.index_copy(0, distinct, values))


@pytest.mark.parametrize(
    "optimizer",
    [*KERNEL_OPTIMIZERS, optim.Adagrad(lr=0.1, stochastic_rounding=True)],
    ids=lambda optimizer: f"{optimizer.name}{'-stochastic' if optimizer.stochastic_rounding else ''}",
)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [5, 8])  # odd: the float32 state starts after a padding value
def test_16_bit_updates_match_the_torch_backend(build, optimizer, dtype, dim):
    backend, device = build
    generator = torch.Generator().manual_seed(2)
    state_width = optimizer.state_width(dim)
    table = torch.zeros(20, row_width(dim, state_width, True), dtype=dtype)
    table[:, :dim] = torch.randn(20, dim, generator=generator).to(dtype)
    state_of(table, dim, state_width)[:] = torch.rand(20, state_width, generator=generator)
    expected, before, table = table.clone(), table.clone(), table.to(device)
    slots, keys = torch.tensor([3, 17, 0, 9]), torch.tensor([30, 170, 0, 90])
    for step in range(1, 6):
        grad = torch.randn(4, dim, generator=generator) * 10.0**step  # squares past float16's range
        TorchRows().optimizer_step(optimizer, expected, slots, grad, step, keys)
        backend.optimizer_step(optimizer, table, slots.to(device), grad, step, keys)
    table = table.cpu()
    torch.testing.assert_close(table[:, :dim].float(), expected[:, :dim].float(), rtol=ULP[dtype], atol=0)
    got, wanted = (state_of(rows, dim, state_width) for rows in (table, expected))
    torch.testing.assert_close(got, wanted, rtol=1e-6, atol=0)
    if state_width and "adagrad" in optimizer.name:
        assert float(got.max()) > 65504  # float32 state: past what float16 holds
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(table[untouched].view(torch.int16), before[untouched].view(torch.int16))
    assert not torch.equal(table, before)


def test_a_16_bit_update_with_stochastic_rounding_needs_the_rows_ids():
    rows = torch.zeros(4, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="stochastic_rounding draws by the rows' ids: pass keys"):
        KernelRows(shared_host_kernels(), "host").optimizer_step(
            optim.SGD(lr=0.1, stochastic_rounding=True), rows, torch.arange(2), torch.ones(2, 8), 1
        )
