"""The kernels without a GPU: NVRTC compiles them for sm_80 and sm_90 (warnings fail), and
their host build (host_shim.h, one thread) is checked against the torch reference."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import types
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import KERNEL_OPTIMIZERS, hash_table_operations
from host_kernels import parallel_host_kernels
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore.kernels import cuda as kernels
from tierstore.kernels.cache_passes import cache_passes_of
from tierstore.tiers.backends import TorchRows
from tierstore.tiers.hash_index import HashIndex
from tierstore.tiers.kernel_hash_table import MAX_LOAD, SPARSE_LOAD, KernelHashTable


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_kernel_compiles_with_nvrtc_without_warnings(arch):
    cubin = kernels.compile_cubin(kernels.SOURCE, arch)
    assert cubin[:4] == b"\x7fELF"
    for name in (
        "cache_find",
        "cache_insert",
        "cache_erase",
        "cache_touch",
        "cache_victim_scores",
        "cache_pin_add",
        "cache_gather_vec4",
        "cache_gather",
        "cache_scatter",
        "update_sgd",
        "update_adagrad",
        "update_rowwise_adagrad",
        "update_adam",
        "cache_gather_16",
        "cache_scatter_16",
        "update_sgd_16",
        "update_adagrad_16",
        "update_rowwise_adagrad_16",
        "update_adam_16",
        "index_find",
        "index_insert",
        "index_erase",
        "bag_weight_gradient",
    ):
        assert name.encode() in cubin, name


def test_a_compile_error_names_the_file_and_shows_nvrtc_log(tmp_path, monkeypatch):
    (tmp_path / "broken.cu").write_text('extern "C" __global__ void k(int* a) { a[0] = undefined_name; }\n')
    monkeypatch.setattr(kernels, "source_dir", lambda: tmp_path)
    with pytest.raises(
        kernels.CudaError, match=r"(?s)broken.cu: nvrtcCompileProgram for sm_80 .*undefined_name"
    ):
        kernels.compile_cubin("broken.cu", "sm_80")


def test_a_warning_fails_the_compile(tmp_path, monkeypatch):
    (tmp_path / "warns.cu").write_text('extern "C" __global__ void k(int* a) { int unused = 1; a[0] = 0; }\n')
    monkeypatch.setattr(kernels, "source_dir", lambda: tmp_path)
    with pytest.raises(
        kernels.CudaError, match=r"(?s)warns.cu.*\"unused\" was declared but never referenced"
    ):
        kernels.compile_cubin("warns.cu", "sm_90")


def test_cubins_are_cached_by_source_hash_architecture_and_nvrtc_version(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERSTORE_KERNEL_CACHE", str(tmp_path))
    first = kernels.cached_cubin(kernels.SOURCE, "sm_80")
    (cached,) = tmp_path.glob("*.cubin")
    major, minor = kernels.nvrtc_version()
    assert "sm_80" in cached.name and f"nvrtc{major}.{minor}" in cached.name
    monkeypatch.setattr(kernels, "compile_cubin", lambda *args: pytest.fail("recompiled despite the cache"))
    assert kernels.cached_cubin(kernels.SOURCE, "sm_80") == first


# -- the hash table: the kernel table and the torch HashIndex against one dict ------------------


@pytest.mark.parametrize("value_dtype", [torch.int32, torch.int64])
@settings(max_examples=100, deadline=None)
@given(hash_table_operations, st.integers(1, 8))
def test_kernel_hash_table_matches_the_torch_index_and_a_dict(host, value_dtype, ops, capacity):
    """int32 values (cache slots) and int64 values past 2^32 (row numbers of huge files)."""
    table, reference, oracle = KernelHashTable(capacity, host, "cpu", value_dtype), HashIndex(capacity), {}
    value_base = 0 if value_dtype == torch.int32 else 5 << 32
    for step, (op, keys) in enumerate(ops):
        if op == "insert":
            keys = [k for k in keys if k not in oracle]
            values = torch.tensor([value_base + k * 10 + step for k in keys], dtype=torch.int64)
            table.insert(torch.tensor(keys, dtype=torch.int64), values)
            reference.insert(torch.tensor(keys, dtype=torch.int64), values)
            oracle.update(zip(keys, values.tolist()))
        elif op == "remove":
            batch = torch.tensor(keys, dtype=torch.int64)
            expected = [oracle.pop(k, -1) for k in keys]
            assert table.remove(batch).tolist() == expected == reference.remove(batch).tolist()
        lookup = torch.tensor(keys + keys[:3], dtype=torch.int64)  # repeated keys too
        assert table.find(lookup).tolist() == [oracle.get(k, -1) for k in lookup.tolist()]
        assert torch.equal(table.find(lookup), reference.find(lookup))
        assert len(table) == len(oracle)
    keys, values = table.items()
    assert dict(zip(keys.tolist(), values.tolist())) == oracle


def test_erase_by_shifting_keeps_every_key_reachable_in_a_crowded_table():
    """The tuned host build's erase moves entries back (no tombstones): at the most crowded load the
    table allows, with keys sharing home positions and chains wrapping past the end, every live key
    is still found and every removed one is gone, against a dict. Its serial insert and the tier's
    resolve probe such a small table four positions at a time: they agree with the dict too, on
    chains ending at each of the four and past them."""
    table, generator, oracle = (
        KernelHashTable(64, parallel_host_kernels(), "cpu"),
        np.random.default_rng(0),
        {},
    )
    passes = cache_passes_of(parallel_host_kernels())
    tier = types.SimpleNamespace(index=table, slot_keys=torch.empty(0, dtype=torch.int64), direct=None)
    scores = torch.zeros(8 << 16, dtype=torch.float32)  # past every value the test gives (k * 7 + step)
    positions = table.keys.numel()
    homes_at_the_end = [k for k in range(2000, 1 << 16) if (_mix(k) & (positions - 1)) >= positions - 3][:40]
    pool = np.array(homes_at_the_end + list(range(1000, 1100)))
    for step in range(400):
        absent = [int(k) for k in pool if int(k) not in oracle]
        room = 64 - len(oracle)
        incoming = list(
            generator.choice(absent, size=min(room, int(generator.integers(0, 12))), replace=False)
        )
        table.insert(torch.tensor(incoming, dtype=torch.int64), torch.tensor(incoming) * 7 + step)
        oracle.update({k: k * 7 + step for k in incoming})
        leaving = generator.choice(pool, size=int(generator.integers(0, 12)), replace=False).tolist()
        former = table.remove(torch.tensor(leaving, dtype=torch.int64))
        assert former.tolist() == [oracle.pop(k, -1) for k in leaving]
        assert table.find(torch.from_numpy(pool)).tolist() == [oracle.get(int(k), -1) for k in pool]
        slots, *_ = passes.resolve(tier, torch.from_numpy(pool), torch.ones(len(pool)), scores, 1.0)
        assert slots.tolist() == [oracle.get(int(k), -1) for k in pool]
    assert table.tombstones == 0 and int((table.keys == -2).sum()) == 0 and len(table) == len(oracle)


def _mix(key: int) -> int:
    """The kernels' hash (splitmix64's finaliser), for picking keys by home position."""
    mask = (1 << 64) - 1
    key ^= key >> 30
    key = (key * 0xBF58476D1CE4E5B9) & mask
    key ^= key >> 27
    key = (key * 0x94D049BB133111EB) & mask
    return key ^ (key >> 31)


def test_insert_kernel_reports_repeated_keys_and_a_full_table(host):
    """Which of two racing repeats wins is up to the threads; exactly one does."""
    keys = torch.full((16,), -1, dtype=torch.int64)
    values = torch.full((16,), -1, dtype=torch.int32)
    status = torch.empty(4, dtype=torch.int32)
    host.launch(
        "cache_insert",
        4,
        keys,
        values,
        15,
        torch.tensor([5, 9, 5, 9]),
        torch.tensor([0, 1, 2, 3], dtype=torch.int32),
        4,
        status,
    )
    assert sorted(status[[0, 2]].tolist()) == [0, 1] and sorted(status[[1, 3]].tolist()) == [0, 1]
    found = torch.empty(2, dtype=torch.int32)
    host.launch("cache_find", 2, keys, values, 15, torch.tensor([5, 9]), 2, found)
    assert found.tolist() == [int(status[0] != 0) * 2, 1 + int(status[1] != 0) * 2]  # the winner's value
    many = torch.arange(100, 120)
    status = torch.empty(20, dtype=torch.int32)
    host.launch("cache_insert", 20, keys, values, 15, many, torch.arange(20, dtype=torch.int32), 20, status)
    assert sorted(status.tolist()) == [0] * 14 + [2] * 6  # 16 positions, 2 taken: 6 find the table full
    assert int((keys >= 0).sum()) == 16


def test_serial_insert_and_shifting_erase_on_a_full_table_end():
    """No table below its load limit is full, but the tuned build's serial calls must end on one
    that is: an insert reports it full, an erase empties the key's position and keeps the rest."""
    passes = cache_passes_of(parallel_host_kernels())
    keys = torch.full((16,), -1, dtype=torch.int64)
    values = torch.full((16,), -1, dtype=torch.int32)
    many = torch.arange(100, 117)
    failed, status = passes.insert(keys, values, many, torch.arange(17, dtype=torch.int32))
    assert (failed, status) == (16, 2) and int((keys >= 0).sum()) == 16  # the 17th finds it full
    former, present = passes.erase(keys, values, torch.tensor([103, 999]))
    assert former.tolist() == [3, -1] and present == 1  # an absent key erases nothing
    found = torch.empty(16, dtype=torch.int32)
    parallel_host_kernels().launch("cache_find", 16, keys, values, 15, many[:16], 16, found)
    assert found.tolist() == [-1 if key == 103 else key - 100 for key in range(100, 116)]


def test_kernel_table_refuses_repeated_keys_in_one_insert(host):
    table = KernelHashTable(8, host, "cpu")
    with pytest.raises(ValueError, match="key 3 was already present"):
        table.insert(torch.tensor([3, 3]), torch.tensor([0, 1]))


def test_long_chains_survive_removals_and_the_table_rebuilds(host):
    table, generator = KernelHashTable(64, host, "cpu"), torch.Generator().manual_seed(0)
    resident = torch.randperm(10_000, generator=generator)[:64]
    table.insert(resident, torch.arange(64))
    for step in range(40):  # churn: tombstones pile up, rebuilds clear them
        out = resident[torch.randperm(64, generator=generator)[:16]]
        table.remove(out)
        resident = resident[~torch.isin(resident, out)]
        incoming = torch.arange(10_000 + 16 * step, 10_016 + 16 * step)
        table.insert(incoming, torch.arange(16))
        resident = torch.cat([resident, incoming])
        assert bool((table.find(resident) >= 0).all()) and bool((table.find(out) == -1).all())
    assert table.tombstones < table.keys.numel()


@pytest.mark.parametrize("max_load", [MAX_LOAD, SPARSE_LOAD])
def test_a_growing_kernel_table_doubles_and_stays_at_least_half_its_load_limit(host, max_load):
    """A table that grows (the mmap log's index, keys arriving a batch at a time) doubles: each
    rebuild twice the size before it, the table never past its load limit and, once grown, never
    under half of it (its memory follows its keys)."""
    table = KernelHashTable(1024, host, "cpu", value_dtype=torch.int64, max_load=max_load)
    sizes, rebuild = [table.keys.numel()], table._rebuild
    table._rebuild = lambda size: (sizes.append(size), rebuild(size))
    keys = torch.randint(1 << 40, (20_000,), generator=torch.Generator().manual_seed(0)).unique()
    for batch in keys.split(300):
        table.insert(batch, batch * 3)
        assert len(table) <= max_load * table.keys.numel()
        if len(sizes) > 1:
            assert len(table) >= max_load / 2 * table.keys.numel(), (len(table), table.keys.numel())
    assert sizes == [sizes[0] << i for i in range(len(sizes))] and len(sizes) > 5, sizes
    assert torch.equal(table.find(keys), keys * 3)


def test_a_full_kernel_table_under_steady_churn_rebuilds_rarely(host):
    """A full cache tier's index (live keys at MAX_LOAD) removes and inserts a tenth of its keys a
    step: tombstones may fill a quarter of the table before it rebuilds, so not every step; the
    tuned host build's erase shifts entries back instead, leaving no tombstone and no rebuild."""
    table, generator = KernelHashTable(1024, host, "cpu"), torch.Generator().manual_seed(0)
    resident = torch.randperm(1 << 20, generator=generator)[:1024]
    table.insert(resident, torch.arange(1024))
    rebuilds, rebuild = [], table._rebuild
    table._rebuild = lambda size: (rebuilds.append(size), rebuild(size))
    for step in range(30):
        out = resident[torch.randperm(1024, generator=generator)[:100]]
        table.remove(out)
        incoming = torch.arange(100, dtype=torch.int64) + (1 << 21) + 100 * step
        table.insert(incoming, torch.arange(100))
        resident = torch.cat([resident[~torch.isin(resident, out)], incoming])
        assert bool((table.find(resident) >= 0).all()) and bool((table.find(out) == -1).all())
        assert len(table) == 1024 and sorted(table.items()[0].tolist()) == sorted(resident.tolist())
    if host.step_library is not None:
        assert rebuilds == [] and table.tombstones == 0 and int((table.keys == -2).sum()) == 0
    else:
        assert len(rebuilds) <= 6 and set(rebuilds) == {table.keys.numel()}, rebuilds


# -- rows, scores and the fused optimizers against torch -----------------------------------------


def test_gather_and_scatter_match_index_select_and_index_copy(host):
    generator = torch.Generator().manual_seed(1)
    rows = torch.randn(50, 12, generator=generator)
    slots = torch.tensor([7, 3, 3, 49, 0], dtype=torch.int32)  # repeats are fine for a gather
    for name, columns in (("cache_gather_vec4", 8), ("cache_gather", 5)):
        out = torch.empty(5, columns)
        host.launch(
            name,
            5 * columns if name == "cache_gather" else 5 * columns // 4,
            rows,
            12,
            slots,
            5,
            columns,
            out,
        )
        assert torch.equal(out, rows[slots.long(), :columns]), name
    values = torch.randn(3, 12, generator=generator)
    distinct = torch.tensor([4, 40, 9], dtype=torch.int32)
    expected = rows.clone().index_copy_(0, distinct.long(), values)
    host.launch("cache_scatter", 3 * 12, rows, 12, distinct, values, 3, 12)
    assert torch.equal(rows, expected)


def test_touch_accumulates_repeated_slots_like_index_add(host):
    scores = torch.zeros(10)
    slots = torch.tensor([1, 4, 1, 1, 9], dtype=torch.int32)
    weights = torch.tensor([0.5, 1.0, 2.0, 0.25, 3.0])
    host.launch("cache_touch", 5, scores, slots, weights, 5)
    assert torch.equal(scores, torch.zeros(10).index_add_(0, slots.long(), weights))


def test_pin_add_counts_up_and_down_like_the_torch_backend(host):
    pins = torch.tensor([0, 3, 255, 1, 0], dtype=torch.uint8)
    slots = torch.tensor([0, 2, 3], dtype=torch.int32)
    expected = pins.clone()
    TorchRows().add_pins(expected, slots.long(), 1)
    host.launch("cache_pin_add", 3, pins, slots, 3, 1)
    assert pins.tolist() == expected.tolist() == [1, 3, 0, 2, 0]
    TorchRows().add_pins(expected, slots.long(), -1)
    host.launch("cache_pin_add", 3, pins, slots, 3, -1)
    assert pins.tolist() == expected.tolist() == [0, 3, 255, 1, 0]


def test_victim_scores_block_free_and_needed_slots(host):
    scores = torch.tensor([5.0, 1.0, 3.0, 0.5, 2.0])
    slot_keys = torch.tensor([10, 11, -1, 13, 14])
    needed = torch.tensor([0, 0, 0, 1, 0], dtype=torch.uint8)
    out = torch.empty(5)
    host.launch("cache_victim_scores", 5, scores, slot_keys, needed, float("inf"), 5, out)
    assert out.tolist() == [5.0, 1.0, float("inf"), float("inf"), 2.0]
    assert torch.topk(out, 2, largest=False).indices.tolist() == [1, 4]


@pytest.mark.parametrize("optimizer", KERNEL_OPTIMIZERS)
def test_update_kernels_match_the_torch_optimizers(host, optimizer):
    dim, generator = 8, torch.Generator().manual_seed(2)
    width = dim + optimizer.state_width(dim)
    table = torch.rand(20, width, generator=generator)
    expected, before = table.clone(), table.clone()
    slots = torch.tensor([3, 17, 0, 9], dtype=torch.int32)
    for step in range(1, 6):
        grad = torch.randn(4, dim, generator=generator)
        optimizer.update(expected, slots.long(), grad, step)
        name, arguments, per_row = optimizer.kernel(step)
        host.launch(name, 4 if per_row else 4 * dim, table, width, slots, grad, 4, dim, *arguments)
    torch.testing.assert_close(table, expected, rtol=1e-6, atol=1e-7)
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[slots.long()] = False
    assert torch.equal(table[untouched], before[untouched]) and not torch.equal(table, before)


def test_grid_stride_loops_cover_every_item_in_any_grid(host):
    """A kernel must handle n larger than its grid: the host build runs one thread for all n."""
    rows = torch.arange(4000 * 4, dtype=torch.float32).reshape(4000, 4)
    slots = torch.from_numpy(np.random.default_rng(3).permutation(4000)).to(torch.int32)
    out = torch.empty(4000, 4)
    host.launch("cache_gather_vec4", 4000, rows, 4, slots, 4000, 4, out)
    assert torch.equal(out, rows[slots.long()])


def test_device_cache_backend_choice_is_checked_and_reported(tmp_path):
    from tierstore import TieredStore

    with pytest.raises(ValueError, match="device_cache_backend='cuda' cannot run here .*not a CUDA device"):
        TieredStore(tmp_path / "a", dim=4, device_cache=8, device_cache_backend="cuda")
    with pytest.raises(ValueError, match="'auto', 'cuda' or 'torch'"):
        TieredStore(tmp_path / "b", dim=4, device_cache=8, device_cache_backend="triton")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # refused before creating anything
    with TieredStore(tmp_path / "c", dim=4, device_cache=8) as store:  # auto on a CPU device: torch
        assert store.stats()["device"]["backend"] == "torch"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_backend_without_a_gpu_says_so(tmp_path):
    from tierstore import TieredStore

    with pytest.raises(ValueError, match="cannot run here .torch sees no CUDA device"):
        TieredStore(tmp_path / "s", dim=4, device="cuda", device_cache=8, device_cache_backend="cuda")
    assert not (tmp_path / "s").exists()


def test_a_wheel_installed_in_a_fresh_environment_compiles_its_kernels_from_the_installed_sources(tmp_path):
    """The sources live in the top-level cuda/ and ship in the wheel as ``tierstore.kernel_sources``:
    a wheel installed in a new virtual environment (not the source tree) finds them, and g++ (and
    NVRTC, where installed) compiles the kernels from its own copy."""
    root = tmp_path / "source"  # a copy: the build leaves build/ and *.egg-info behind
    skipped = shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*cache", ".hypothesis"
    )
    shutil.copytree(Path(__file__).parent.parent, root, ignore=skipped)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "wheel"), str(root)],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "wheel").glob("tierstore-*.whl")
    sources = ["embedding_cache.cu", "host_ageing.cpp", "host_cache.cpp", "host_horizon.cpp", "host_shim.h"]
    sources += ["host_step.cpp", "replay.cpp"]
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert all(f"tierstore/kernel_sources/{name}" in names for name in sources)
    modules = sorted(str(path.relative_to(root)) for path in (root / "tierstore").rglob("*.py"))
    assert [name for name in modules if name not in names] == []  # pyproject.toml lists every package
    environment = tmp_path / "venv"  # torch and the rest from this interpreter's site-packages
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(environment)], check=True)
    python = environment / "bin" / "python"
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
    )
    check = textwrap.dedent(
        """
        import json, tierstore
        from tierstore.kernels import host, source_dir
        from tierstore.kernels.cuda import compile_cubin
        shown = {"package": tierstore.__file__, "sources": str(source_dir())}
        shown["host"] = str(host.build(parallel=False))
        try:
            shown["cubin"] = len(compile_cubin())
        except Exception as error:
            shown["cubin"] = repr(error)
        print(json.dumps(shown))
        """
    )
    shown = json.loads(
        subprocess.run(
            [python, "-c", check],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "TIERSTORE_KERNEL_CACHE": str(tmp_path / "kernels")},
        ).stdout
    )
    assert shown["package"].startswith(str(environment)) and shown["sources"].startswith(str(environment))
    assert shown["sources"].endswith("tierstore/kernel_sources")
    assert (
        Path(shown["host"]).is_file() and Path(shown["host"]).parent == tmp_path / "kernels"
    )  # built just now
    assert isinstance(shown["cubin"], int) and shown["cubin"] > 0, shown["cubin"]  # NVRTC: the dev extra


def test_a_checkout_compiles_its_kernels_from_the_top_level_cuda_folder():
    """An editable install (or the source tree on the path) reads the kernels from ``cuda/`` itself,
    so an edited kernel is what the next build compiles."""
    import tierstore
    from tierstore.kernels import source_dir

    root = Path(__file__).resolve().parent.parent
    if not Path(tierstore.__file__).resolve().is_relative_to(root):
        pytest.skip("tierstore is imported from an installed wheel here, not from this checkout")
    assert source_dir().resolve() == root / "cuda"
    assert (source_dir() / kernels.SOURCE).is_file()


@pytest.mark.skipif(
    os.uname().machine != "x86_64" or shutil.which("objdump") is None,
    reason="counts x86-64 prefetch instructions in the tuned build with objdump",
)
def test_the_tuned_build_keeps_the_prefetches_its_helpers_ask_for():
    """GCC counts a prefetch as no effect and deleted calls to helpers that only prefetch, unless they
    are inlined (``host_shim.h``'s ``PREFETCHING``): the tuned build's lookups by key ask for each
    key's memory ahead, counted in their machine code."""
    from tierstore.kernels.host import build

    listing = subprocess.run(
        ["objdump", "-d", "-C", "--no-show-raw-insn", str(build(parallel=True))],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    counts, function = {}, None
    for line in listing.splitlines():
        if line.endswith(">:"):
            function = line.split("<", 1)[1][:-2]
            counts[function] = 0
        elif function is not None and "prefetch" in line.split("\t")[-1]:
            counts[function] += 1

    def prefetches(prefix: str) -> int:
        return sum(count for name, count in counts.items() if name.startswith(prefix))

    # the slots found beside the dedupe: each key's home slot, else its index home (key and value)
    assert prefetches("step_lookup_bags") >= 3
    # the log's table home and each run's filter word and directory entry, then the runs' mixes and
    # values, the main index's home, the stored row's lines
    assert prefetches("locate_stored_rows") >= 9
