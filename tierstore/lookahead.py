"""``prefetch``: a lookahead pipeline that moves the next batches' rows up the tiers while this
batch trains.

The batches of an epoch are known before they are trained (Bagpipe's oracle cacher, TorchRec's
prefetch pipeline). With ``background=True`` a worker thread reads up to ``lookahead`` batches
ahead of the training loop; for each it moves the rows the batch will look up (those the table
holds; new ids are added by the batch itself) into the top tier and pins them there until the batch
has run. The step then finds its rows resident, and no eviction takes a row the window needs:
victims come from the rows outside the window, by the tier's own policy (LFU with ageing), which is
Belady's choice within the window. Tiers are exclusive and a move carries a row whole, so training
gives the same rows with or without the pipeline, bit for bit; the store's lock orders the worker's
moves and the loop's lookups and updates.

By default (``background=None`` or False) the pipeline runs inline: batches pass straight through,
each step makes its own rows resident, and a ``warm`` ranking is loaded a chunk after each batch.
The worker (``background=True``) was measured slower on every workload tried, with and without a
core of its own and with cold reads from disk: it holds the store's lock for its moves and the GIL
for its Python, so the step waits on it rather than overlapping it (README, "Worker or inline").

Pinned rows count in the top tier's budget: the window pins at most the tier's capacity less the
largest batch's distinct rows, so any batch fits beside it. A batch that does not fit waits for
earlier ones to run (the window shrinks); one larger than that is not pinned at all. Both are
counted in ``store.stats()["prefetch"]``.
"""

from __future__ import annotations

import atexit
import dataclasses
import queue
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from .budget import horizon_accesses
from .horizon_reader import HorizonReader
from .kernels.host import openmp_runtime
from .prefetch_stats import PrefetchStats

MAX_LOOKAHEAD = 64  # a row's pin count is one byte: the window's batches and the current one
PRELOAD_CHUNK = 1 << 16  # ranked ids the worker loads at a time (the store's lock is held meanwhile)
EXIT_WAIT_S = 30.0  # at the interpreter's exit, how long a worker is waited for (it ends its batch)


@dataclasses.dataclass
class _Pins:
    """The rows pinned in ``store`` for one batch (``count`` keys asked for)."""

    store: Any
    count: int
    keys: Any
    slots: Any
    unheld: int  # of them, rows the horizon does not pin (0 without one)


@dataclasses.dataclass
class _Failure:
    error: BaseException


_END = object()
_EXITED = object()  # the worker's last item, after any other: nothing more will come


def prefetch(
    batches: Iterable,
    module: Any,
    lookahead: int = 8,
    ids: Callable[[Any], Any] | None = None,
    warm: Any = None,
    background: bool | None = None,
    horizon: int | str | None = None,
    horizon_ids: Iterable | None = None,
) -> Iterator:
    """Yield ``batches`` unchanged and in order; with ``background=True``, while a worker thread
    moves the rows of the next ``lookahead`` batches into ``module``'s top cache tier.

    ``module``: a ``TieredEmbeddingBag``, ``TieredEmbedding`` or ``TieredEmbeddingBagCollection``
    (or a ``TieredStore``, whose ``get`` the loop calls). ``ids(batch)``: what the module is called
    with for that batch (its ``input`` ids, or a ``KeyedJaggedTensor``); default: the batch
    itself. An error of the loader or the store in the background is raised in the loop at the
    batch it concerns, as is an ``ids(batch)`` that is not ids at all (None, strings, floats: a
    ``TypeError`` naming ``ids``); ids ``module`` refuses (negative, past ``num_embeddings``) are
    not prefetched, and its step raises.
    ``warm``: a hot-set ranking, as the module's ``warm=`` takes it, whose rows the worker loads
    into the caches' free slots in the background, a chunk at a time while its window is full
    (a warm start that does not hold up the first batches).
    Leaving the loop (``break``, an exception) stops the worker and unpins its rows.
    ``background``: run the worker (True) or the inline pipeline (False, or None: the default; see
    the module docstring).
    ``horizon``: also read the ids of the batches up to this many row lookups ahead (an int, a
    batch counting its distinct ids per store, or ``"10x"``: ten times the top tier's capacity)
    and evict by next use (``tierstore.horizon``), in either mode; the batches read that far
    ahead are held meanwhile, unless ``horizon_ids`` (an iterable of what ``ids(batch)`` gives,
    batch for batch, e.g. from the id columns alone) feeds the horizon instead.
    """
    if not hasattr(module, "store_keys"):
        raise TypeError(
            "module must be a TieredEmbeddingBag, TieredEmbedding, TieredEmbeddingBagCollection or "
            "TieredStore, "
            f"got {type(module).__name__}"
        )
    if isinstance(lookahead, bool) or not isinstance(lookahead, int) or not 1 <= lookahead <= MAX_LOOKAHEAD:
        raise ValueError(f"lookahead must be an int in [1, {MAX_LOOKAHEAD}] (batches), got {lookahead!r}")
    if ids is not None and not callable(ids):
        raise TypeError(f"ids must be a function of a batch or None, got {type(ids).__name__}")
    try:
        iterator = iter(batches)
    except TypeError:
        raise TypeError(
            f"batches must be an iterable of batches (a DataLoader, a list, a generator), "
            f"got {type(batches).__name__}"
        ) from None
    if background is not None and not isinstance(background, bool):
        raise TypeError(f"background must be True, False or None (the default: inline), got {background!r}")
    if horizon is not None:
        horizon_accesses(horizon, 1)  # a bad horizon raises here
    elif horizon_ids is not None:
        raise ValueError("horizon_ids feeds a horizon: pass horizon= too (e.g. horizon='10x')")
    preloads = [] if warm is None else module.warm_keys(warm)  # a bad ranking raises here
    ahead = None
    if horizon is not None:
        ahead = HorizonReader(iterator, module, ids, horizon, horizon_ids, lookahead)
        iterator = ahead
    if not background:
        return _inline(iterator, lookahead, preloads, ahead)
    pipeline = _Pipeline(iterator, module, lookahead, ids, ahead)
    pipeline.preload_later(preloads)
    return pipeline.run()


def _inline(
    batches: Iterator, lookahead: int, preloads: list[tuple[Any, torch.Tensor]], ahead: HorizonReader | None
) -> Iterator:
    """The pipeline without a worker: ``batches`` pass straight through (``ahead``, their horizon,
    told when each has run); a chunk of the warm ranking (``(store, ranked ids)``) is loaded after
    each batch has run."""
    chunks = [(store, chunk) for store, ranked in preloads for chunk in ranked.split(PRELOAD_CHUNK)]
    stats = {id(store): PrefetchStats(lookahead) for store, _ in preloads}
    for store, _ in preloads:
        store.prefetch_stats = stats[id(store)]
    try:
        for batch in batches:
            yield batch
            if ahead is not None:
                ahead.ran()
            if chunks:
                store, chunk = chunks.pop(0)
                stats[id(store)].warmed_rows += store.preload(chunk)
    finally:
        if ahead is not None and not sys.is_finalizing():  # the process exits: its pins go with it
            ahead.release()


class _Pipeline:
    def __init__(
        self,
        batches: Iterator,
        module: Any,
        lookahead: int,
        ids: Callable | None,
        ahead: HorizonReader | None,
    ) -> None:
        self._batches = batches
        self._ahead = ahead
        if ahead is not None:  # the horizon's pins leave the window its room
            ahead.window_rows = self._window_rows
        self._module = module
        self._lookahead = lookahead
        self._ids = ids
        self._read = 0  # batches read from the loader
        self._ready: queue.Queue = queue.Queue()  # (batch, pins), then _END or a _Failure; _EXITED
        self._changed = threading.Condition()  # guards what follows
        self._queued = 0  # batches read ahead, not yet handed to the loop
        self._stopping = False
        self._pinned: dict[int, int] = {}  # id(store) -> rows pinned now
        self._unheld: dict[int, int] = {}  # id(store) -> of those, rows the horizon did not pin then
        self._largest: dict[int, int] = {}  # id(store) -> most distinct keys a batch had
        self._stats: dict[int, PrefetchStats] = {}
        self._preloads: list[tuple[Any, torch.Tensor]] = []  # (store, ranked ids) chunks left
        self._worker = threading.Thread(target=self._work, name="tierstore-prefetch", daemon=True)

    def preload_later(self, rankings: list[tuple[Any, torch.Tensor]]) -> None:
        """Have the worker load ``rankings`` (``(store, ranked ids)``) while its window is full."""
        for store, ranked in rankings:
            self._stats_of(store)
            self._preloads.extend((store, chunk) for chunk in ranked.split(PRELOAD_CHUNK))

    def _window_rows(self, store: Any) -> int:
        """Slots of ``store``'s top tier the window holds beside the horizon's pins: rows it pins
        that the horizon did not pin when it pinned them (its other rows take no slot more)."""
        return self._unheld.get(id(store), 0)

    def _stats_of(self, store: Any) -> PrefetchStats:
        stats = self._stats.get(id(store))
        if stats is None:
            stats = self._stats[id(store)] = store.prefetch_stats = PrefetchStats(self._lookahead)
        return stats

    def run(self) -> Iterator:
        _RUNNING.add(self)
        self._worker.start()
        current: list[_Pins] = []
        try:
            while True:
                item = self._ready.get()
                if item is _EXITED:  # stopped from outside (the interpreter exits)
                    return
                with self._changed:
                    self._queued -= 1
                    self._changed.notify_all()
                if item is _END:
                    return
                if isinstance(item, _Failure):
                    raise item.error
                batch, current = item
                yield batch
                self._release(current)
                current = []
                if self._ahead is not None:
                    self._ahead.ran()
        finally:
            self._stop(current)

    # -- the worker ----------------------------------------------------------------------------

    def _work(self) -> None:
        _one_openmp_thread()
        try:
            while True:
                with self._changed:
                    while self._queued >= self._lookahead and not self._stopping and not self._preloads:
                        self._changed.wait()
                    if self._stopping:
                        return
                    ahead = self._queued < self._lookahead
                    self._queued += ahead
                if not ahead:  # the window is full: warm the caches meanwhile
                    store, chunk = self._preloads.pop(0)
                    self._stats_of(store).warmed_rows += store.preload(chunk)
                    continue
                try:
                    batch = next(self._batches)
                except StopIteration:
                    self._ready.put(_END)
                    return
                self._read += 1
                self._ready.put((batch, self._pin(batch)))
        except BaseException as error:  # the loop raises it at this batch
            self._ready.put(_Failure(error))
        finally:  # a stopping loop waits for this, not for a timeout
            self._ready.put(_EXITED)

    def _pin(self, batch: Any) -> list[_Pins]:
        """Pin the rows of ``batch`` in each store it looks up, waiting for room."""
        looked_up = batch if self._ids is None else self._ids(batch)
        try:
            wanted = self._module.store_keys(looked_up)
        except TypeError as error:  # not ids at all: nothing would ever be prefetched
            source = "the batch itself (no ids= given)" if self._ids is None else "ids(batch)"
            raise TypeError(
                f"prefetch: batch {self._read - 1}: {source} is {type(looked_up).__name__}, not what "
                f"{type(self._module).__name__} looks up ({error}); pass ids= a function of a batch "
                f"that returns the module's input (its ids, or a KeyedJaggedTensor)"
            ) from None
        except (ValueError, IndexError, KeyError):
            return []  # ids the module refuses: the step refuses this batch, with the module's own message
        pins: list[_Pins] = []
        try:
            for store, keys in wanted:
                pinned = self._pin_in(store, keys)
                if pinned is not None:
                    pins.append(pinned)
        except BaseException:
            self._release(pins)
            raise
        return pins

    def _pin_in(self, store: Any, keys: Any) -> _Pins | None:
        key = id(store)
        stats = self._stats_of(store)
        stats.batches += 1
        count = keys.numel()
        if count == 0:
            return None
        largest = self._largest[key] = max(self._largest.get(key, 0), count)
        room = store.stack.top.max_capacity - largest  # any batch fits beside the window
        with self._changed:
            pinned, waited = self._pinned.get(key, 0), False
            while pinned and pinned + count > room and not self._stopping:
                waited = True
                self._changed.wait()
                pinned = self._pinned.get(key, 0)
            stats.waits += waited
            if self._stopping:
                return None
            if count > room:
                stats.skipped_batches += 1
                return None
            self._pinned[key] = pinned + count
        if self._ahead is None:
            (held, slots, moved), unheld = store.pin_rows(keys), 0
        else:  # the horizon's pins on these rows only grow until they run: its cap drops none
            held, slots, moved, unheld = self._ahead.pin_window(store, keys)
        with self._changed:
            self._unheld[key] = self._unheld.get(key, 0) + unheld
            stats.pinned_batches += 1
            stats.rows_moved_up += moved
            stats.window_batches += 1
            stats.pinned_rows += count
        return _Pins(store, count, held, slots, unheld)

    # -- both threads --------------------------------------------------------------------------

    def _release(self, pins: list[_Pins]) -> None:
        """Unpin ``pins`` (a batch that has run, or was never handed out) and wake the worker."""
        for pinned in pins:
            pinned.store.unpin_rows(pinned.keys, pinned.slots)
        with self._changed:
            for pinned in pins:
                key = id(pinned.store)
                self._pinned[key] -= pinned.count
                self._unheld[key] -= pinned.unheld
                stats = self._stats[key]
                stats.window_batches -= 1
                stats.pinned_rows -= pinned.count
            self._changed.notify_all()

    def stop_worker(self, timeout: float | None = None) -> None:
        """Have the worker stop after the batch it is reading or pinning, and wait for it."""
        self._ask_to_stop()
        if self._worker.is_alive():
            self._worker.join(timeout)

    def _ask_to_stop(self) -> None:
        with self._changed:
            self._stopping = True
            self._changed.notify_all()

    def _stop(self, current: list[_Pins]) -> None:
        """Stop the worker (it finishes the batch it is reading or pinning) and unpin everything."""
        self._ask_to_stop()
        if sys.is_finalizing():  # the process exits (a loop left unfinished): its pins go with it
            return
        self._release(current)
        try:
            self._drain()
        finally:
            if self._ahead is not None:
                self._ahead.release()

    def _drain(self) -> None:
        """Unpin the batches read ahead and not handed out, until the worker has stopped."""
        while True:
            try:
                item = self._ready.get(timeout=0.05)
            except queue.Empty:  # it exits when the batch it reads or pins is done
                if not self._worker.is_alive():
                    break
                continue
            if item is _EXITED:
                break
            if isinstance(item, tuple):
                self._release(item[1])
        self._worker.join()


_RUNNING: weakref.WeakSet[_Pipeline] = weakref.WeakSet()  # pipelines whose worker was started


@atexit.register
def _stop_workers_at_exit() -> None:
    """Stop the workers of loops left unfinished, before the interpreter finalizes: a thread still
    inside a native call then is ended there, which aborts the process."""
    for pipeline in list(_RUNNING):
        pipeline.stop_worker(EXIT_WAIT_S)


def _one_openmp_thread() -> None:
    """Run this thread's parallel loops (torch's and the kernels') on one thread: the training
    thread's OpenMP team keeps the cores, and two teams spinning on them would slow both.
    OpenMP's thread count is per thread; ``torch.set_num_threads`` would change the default of
    every thread started later too."""
    torch.get_num_threads()  # torch's first call in a thread sets its count: make it before ours
    runtime = openmp_runtime()
    if runtime is not None:  # under another OpenMP runtime its default stands
        runtime.omp_set_num_threads(1)
