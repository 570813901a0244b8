"""The benchmarks' own measurements that are not timings of a method: what a new page of the page
cache costs (``bench_dlrm.new_page_microseconds``)."""

import importlib.util
import math
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def bench_dlrm(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # it imports bench_train beside it
    spec = importlib.util.spec_from_file_location("_bench_dlrm_probe", BENCH / "bench_dlrm.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_the_new_page_probe_writes_new_pages_and_leaves_nothing_behind(tmp_path, monkeypatch):
    module = bench_dlrm(monkeypatch)
    written = []
    real_open = open

    def watched_open(path, *arguments, **keywords):  # what it writes, and where
        file = real_open(path, *arguments, **keywords)
        written.append(Path(path))
        return file

    monkeypatch.setattr(module, "open", watched_open, raising=False)
    microseconds = module.new_page_microseconds(tmp_path, pages=64)
    assert math.isfinite(microseconds) and microseconds > 0
    assert written and all(path.parent == tmp_path for path in written)
    assert list(tmp_path.iterdir()) == []  # the probe's file is removed
