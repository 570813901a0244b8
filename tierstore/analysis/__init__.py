"""What a trace of ids asks of the cache tiers, as a library (the ``tierstore bench`` and
``profile`` commands print and plot these):

- ``load_trace(spec_or_path, columns=...)``: a trace (``Trace``): a CSV/TSV's id columns fused into
  one key space, Criteo's categorical columns, or a synthetic ``zipf:``/``uniform:``/``drift:`` spec
  (``traces``);
- ``hit_rate_curve(trace, sizes, policies)``: the hit rate of the store's own cache (LFU with its
  ageing chosen online; optionally with a lookahead, a horizon, an admission filter or a warm
  start) and of LRU, FIFO and Belady's MIN at each cache size, and MIN over the store's batches, the
  ceiling of a cache that holds each batch whole (``hit_rates``, ``reference_policies``:
  ``batched_belady_hits``);
- ``profile_trace(trace, sizes, sample_rate, max_ids)``: the curve predicted from a spatial sample of
  the ids, the hot-set sizes and the hot ids ranked (``profile``, ``sampling``);
- ``plan(curve_rows, curve_rates, lookups, row_width, bandwidths, host_memory, device_memory)``
  (with ``measure_bandwidths``): the host and device budgets the cost model recommends
  (``cost_model``).
"""

from .cost_model import Bandwidths, measure_bandwidths, plan
from .hit_rates import hit_rate_curve
from .profile import hot_ids_by_column, profile_trace
from .reference_policies import batched_belady_hits, belady_hits, policy_hit_counts
from .traces import Trace, TraceError, load_trace, split_columns

__all__ = [
    "Bandwidths",
    "Trace",
    "TraceError",
    "batched_belady_hits",
    "belady_hits",
    "hit_rate_curve",
    "hot_ids_by_column",
    "load_trace",
    "measure_bandwidths",
    "plan",
    "policy_hit_counts",
    "profile_trace",
    "split_columns",
]
