"""Row-wise sharding of a tiered table over a ``torch.distributed`` process group, with the hot
rows replicated on every rank (P²RES).

Each rank owns the rows whose key hashes to it (``owner_of``) and keeps them in its own store; it
feeds its own batch (data-parallel input, as TorchRec's row-wise sharding). Forward: the batch's
distinct keys go to their owners (all-to-all), each owner looks up everything it was asked for in
one pass through its tiers and sends the rows back. Backward: each row's gradient goes back to
its owner, which sums the ranks' gradients and applies the fused optimizer once: one process
training on the concatenation of every rank's batch does the same, so the rows come out the same.

Replicated keys (the hot partition) live on every rank: looked up locally, their gradients summed
over the ranks by an all-reduce over the rows any rank touched, and the same update applied to
every replica, so they stay identical (``replica_checksum`` checks it).

Every collective of a step runs on every rank in the same order, whatever its batch holds; the
first one also tells each rank whether the others are training, evaluating, or refused their
input, so one rank's bad input raises on every rank instead of leaving the others waiting.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..errors import ShardingError
from ..hashing import id_hash
from .shard_placement import ShardPlacement

_EVAL, _TRAIN, _REFUSED = 0, 1, -1
_MODES = {_EVAL: "evaluating", _TRAIN: "training"}
CHECK_REPLICAS_ENV = "TIERSTORE_CHECK_REPLICAS"  # debug: compare replicas every N updates


def refuse_prefetch(sharding: RowSharding | None) -> None:
    """A lookahead pipeline moves rows within one process's tiers; a sharded table's rows for a
    batch live on other ranks, so ``tierstore.prefetch`` refuses it (not built yet)."""
    if sharding is not None:
        raise NotImplementedError(
            "tierstore.prefetch does not run a sharded table yet: the rows of a rank's batch live on the "
            "other ranks' stores. Iterate the loader directly"
        )


def owner_of(keys: torch.Tensor, world_size: int) -> torch.Tensor:
    """int64 [N]: the rank that owns each of ``keys`` (int64 [N]): a hash of the key, modulo the ranks."""
    if keys.numel() == 0:
        return torch.zeros(0, dtype=torch.int64)
    return torch.from_numpy((id_hash(keys.cpu().numpy()) % np.uint64(world_size)).astype(np.int64))


@dataclasses.dataclass
class CommStats:
    """Bytes this rank sent to other ranks, by purpose."""

    id_bytes: int = 0  # keys (and counts) to their owners
    row_bytes: int = 0  # rows back to the ranks that asked
    gradient_bytes: int = 0  # gradients to the rows' owners
    replica_bytes: int = 0  # the replicated rows' gradients (all-reduce) and which were touched

    @property
    def total_bytes(self) -> int:
        return self.id_bytes + self.row_bytes + self.gradient_bytes + self.replica_bytes


@dataclasses.dataclass
class Exchange:
    """What a forward's exchange leaves for its backward: where each of the batch's distinct keys
    went, and the rows this rank served."""

    sent: torch.Tensor  # positions in the batch's distinct keys, in the order they were sent
    send_splits: list[int]  # keys sent to each rank
    receive_splits: list[int]  # keys received from each rank
    replicated: torch.Tensor  # positions in the batch's distinct keys of replicated keys
    served: torch.Tensor  # sorted distinct keys this rank looked up in its store
    served_of: torch.Tensor  # for the received keys, then the local replicated ones: index in served
    slots: torch.Tensor | None  # the top tier's slots of served (training)


class RowSharding(ShardPlacement):
    """A table's rows spread over ``group``'s ranks, ``replicated`` keys (int64) on every rank."""

    def __init__(self, group: Any) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "process_group needs torch.distributed initialised: call "
                "torch.distributed.init_process_group first (torchrun sets its environment)"
            )
        try:
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            backend = dist.get_backend(group)
        except (RuntimeError, ValueError) as error:
            raise ValueError(f"process_group is not a usable process group ({error})") from None
        if self.rank < 0:
            raise ValueError("process_group does not include this process; pass a group it belongs to")
        self.group = group
        self.replicated = torch.zeros(0, dtype=torch.int64)  # sorted
        self.flush_record: Path | None = None  # this rank's record of its last collective flush
        self.replicated_record: Path | None = None  # where the replicated keys are recorded
        self.recorded = False  # whether they were read from it
        self.plan: list[dict] = []  # the candidates replicate="auto" weighed
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        )
        self.stats = CommStats()
        # Debug mode: every this many updates, check that the replicas are alike (0: never).
        self.check_replicas_every = int(os.environ.get(CHECK_REPLICAS_ENV, "0") or 0)
        self._updates = 0

    def __getstate__(self):
        raise TypeError(
            "a sharded table does not pickle or deepcopy: its process group belongs to this process. "
            "Save it with flush() on every rank (each rank's store holds its rows) and reopen it "
            "with the same world size"
        )

    def together(
        self, what: str, action: Callable[[], Any], undo: Callable[[Any], None] | None = None
    ) -> Any:
        """``action()`` on every rank, then each learns whether all succeeded: a rank whose action
        raised raises that; the others raise ``ShardingError`` naming it (after ``undo(result)``)."""
        try:
            result = action()
        except BaseException:
            self._all_gather(
                torch.ones(1, dtype=torch.int64, device=self.device), f"while reporting a failed {what}"
            )
            raise
        failed = self._all_gather(torch.zeros(1, dtype=torch.int64, device=self.device), f"after the {what}")
        ranks = failed.nonzero().squeeze(1).tolist()
        if ranks:
            if undo is not None:
                undo(result)
            raise ShardingError(
                f"rank {self.rank}: the {what} failed on rank(s) {ranks}, so it is not complete"
            )
        return result

    # -- agreement -------------------------------------------------------------------------------

    def agree(self, what: str, value: Any) -> None:
        """Every rank must pass an equal ``value`` (JSON-able): ``ShardingError`` naming ``what``
        on every rank if one differs."""
        digests = self._gathered_digests(
            json.dumps(value, sort_keys=True, default=str).encode(), "while agreeing on the settings"
        )
        differing = [rank for rank, other in enumerate(digests) if other != digests[self.rank]]
        if differing:
            raise ShardingError(
                f"rank {self.rank}: ranks {differing} have other {what} than this one; every rank must "
                f"build the table with the same settings"
            )

    def refuse(self, error: BaseException) -> None:
        """This rank's input was refused: tell the others (they raise ``ShardingError``), then raise it."""
        self._exchange_splits(torch.zeros(self.world_size, dtype=torch.int64), _REFUSED)
        raise error

    # -- forward -----------------------------------------------------------------------------------

    def lookup(
        self, store, unique: torch.Tensor, counts: torch.Tensor, training: bool
    ) -> tuple[torch.Tensor, torch.Tensor, Exchange]:
        """``(rows [U, dim], known bool [U], exchange)`` of this rank's sorted distinct keys ``unique``
        (``counts [U]`` lookups each), each from the rank that owns it. ``training``: the keys join
        their tables and ``exchange`` serves ``apply_gradients``; else ``known`` says which keys a
        table held (the others got their initial row)."""
        unique, counts = unique.cpu(), counts.cpu()
        is_replicated = torch.isin(unique, self.replicated)
        replicated = is_replicated.nonzero().squeeze(1)
        shard = (~is_replicated).nonzero().squeeze(1)
        owners = owner_of(unique[shard], self.world_size)
        sent = shard[torch.argsort(owners, stable=True)]
        send_splits = torch.bincount(owners, minlength=self.world_size)
        receive_splits = self._exchange_splits(send_splits, _TRAIN if training else _EVAL)
        requests = self._all_to_all(
            torch.stack([unique[sent], counts[sent]], dim=1),
            receive_splits,
            send_splits.tolist(),
            "in the forward exchange",
        ).cpu()
        self.stats.id_bytes += self._remote(send_splits.tolist()) * 16
        served_keys = torch.cat([requests[:, 0], unique[replicated]])
        served, served_of = torch.unique(served_keys, return_inverse=True)
        served_counts = torch.zeros_like(served).index_add_(
            0, served_of, torch.cat([requests[:, 1], counts[replicated]])
        )

        def serve() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
            if training:
                rows, slots = store.get_distinct(served, served_counts)
                return rows, torch.ones(served.numel(), dtype=torch.bool), slots
            return store.get(served, grow=False), store.contains(served), None

        # A rank whose store fails (a batch too large for its top tier, say) must not leave the
        # others waiting for its rows: every rank learns of it before the rows are sent.
        rows, known, slots = self.together("lookup of the rows a rank serves", serve)
        answer = torch.cat([rows.to(self.device), known.to(self.device, rows.dtype)[:, None]], dim=1)
        received = len(requests)
        answers = self._all_to_all(
            answer[served_of[:received].to(answer.device)],
            send_splits.tolist(),
            receive_splits,
            "in the forward exchange",
        )
        self.stats.row_bytes += self._remote(receive_splits) * answer.shape[1] * answer.element_size()
        out = answer.new_empty(unique.numel(), answer.shape[1])
        out[sent.to(out.device)] = answers
        out[replicated.to(out.device)] = answer[served_of[received:].to(answer.device)]
        exchange = Exchange(sent, send_splits.tolist(), receive_splits, replicated, served, served_of, slots)
        return out[:, :-1], out[:, -1].bool().cpu(), exchange

    # -- backward ----------------------------------------------------------------------------------

    def apply_gradients(self, store, exchange: Exchange, grad: torch.Tensor, optimizer, step: int) -> None:
        """The fused ``optimizer`` step with ``grad [U, dim]`` (the batch's distinct keys' gradients):
        each row's gradient summed over the ranks and applied where the row lives."""
        grad = grad.to(self.device)
        received = sum(exchange.receive_splits)
        gradients = self._all_to_all(
            grad[exchange.sent.to(grad.device)],
            exchange.receive_splits,
            exchange.send_splits,
            "in the backward exchange",
        )
        self.stats.gradient_bytes += self._remote(exchange.send_splits) * grad.shape[1] * grad.element_size()
        served_grad = grad.new_zeros(exchange.served.numel(), grad.shape[1])
        served_grad.index_add_(0, exchange.served_of[:received].to(grad.device), gradients)
        elsewhere = torch.zeros(0, dtype=torch.int64), grad[:0]
        if self.replicated.numel():
            positions = torch.searchsorted(self.replicated, exchange.served[exchange.served_of[received:]])
            touched = self._union(positions)
            summed = grad.new_zeros(touched.numel(), grad.shape[1])
            mine = torch.searchsorted(touched, positions)
            summed[mine.to(grad.device)] = grad[exchange.replicated.to(grad.device)]
            self._all_reduce(summed, "while summing the replicas' gradients")
            self.stats.replica_bytes += (
                2 * (self.world_size - 1) * summed.numel() * summed.element_size() // self.world_size
            )
            served_grad[exchange.served_of[received:].to(grad.device)] = summed[mine.to(grad.device)]
            others = torch.ones(touched.numel(), dtype=torch.bool)
            others[mine] = False
            elsewhere = self.replicated[touched[others]], summed[others.to(grad.device)]
        grad_dtype = store.dtype
        if exchange.served.numel():
            store.apply_gradients(
                exchange.served, served_grad.to(grad_dtype), optimizer, step, exchange.slots
            )
        if elsewhere[0].numel():  # replicas of rows only other ranks looked up: the same update
            store.apply_gradients(elsewhere[0], elsewhere[1].to(grad_dtype), optimizer, step)
        self._updates += 1
        if self.check_replicas_every and self._updates % self.check_replicas_every == 0:
            self.replica_checksum(store)

    def replica_checksum(self, store) -> None:
        """Check that every rank holds the same replicated rows (weights and optimizer state):
        ``ShardingError`` on every rank naming the ranks that differ."""
        held = b""
        if self.replicated.numel():
            held = store.get(self.replicated, with_state=True, grow=False).cpu().numpy().tobytes()
        digests = self._gathered_digests(held, "while checking the replicas")
        differing = [rank for rank, other in enumerate(digests) if other != digests[0]]
        if differing:
            raise ShardingError(f"the replicated rows of ranks {differing} differ from rank 0's")

    # -- collectives -------------------------------------------------------------------------------

    def _gathered_digests(self, data: bytes, phase: str) -> list[int]:
        """Every rank's digest (64 bits of SHA-256) of its ``data``, by rank."""
        digest = int.from_bytes(hashlib.sha256(data).digest()[:8], "little", signed=True)
        return self._all_gather(torch.tensor([digest], dtype=torch.int64, device=self.device), phase).tolist()

    def _remote(self, splits: list[int]) -> int:
        """Of ``splits`` (one count per rank), those bound for other ranks."""
        return sum(splits) - splits[self.rank]

    def _exchange_splits(self, send_splits: torch.Tensor, mode: int) -> list[int]:
        """Each rank's count of keys for this one; every rank's mode checked against this one's."""
        message = torch.stack([send_splits, torch.full_like(send_splits, mode)], dim=1).to(self.device)
        received = self._all_to_all(
            message, [1] * self.world_size, [1] * self.world_size, "while starting a step"
        ).cpu()
        modes = received[:, 1].tolist()
        refused = [rank for rank, other in enumerate(modes) if other == _REFUSED]
        if mode == _REFUSED:
            return []
        if refused:
            raise ShardingError(
                f"rank {self.rank}: rank(s) {refused} refused their input, so no rank ran this step"
            )
        others = [rank for rank, other in enumerate(modes) if other != mode]
        if others:
            raise ShardingError(
                f"rank {self.rank} is {_MODES[mode]} but rank(s) {others} are not: call train() or eval() "
                f"alike on every rank"
            )
        return received[:, 0].tolist()

    def _union(self, positions: torch.Tensor) -> torch.Tensor:
        """The sorted distinct ``positions`` (int64) of every rank."""
        sizes = self._all_gather(
            torch.tensor([positions.numel()], device=self.device), "while gathering the replicas touched"
        )
        padded = torch.full((int(sizes.max()),), -1, dtype=torch.int64, device=self.device)
        padded[: positions.numel()] = positions.to(self.device)
        gathered = self._all_gather(padded, "while gathering the replicas touched").cpu()
        self.stats.replica_bytes += (self.world_size - 1) * padded.numel() * 8
        return torch.unique(gathered[gathered >= 0])

    def _all_to_all(
        self, tensor: torch.Tensor, output_splits: list[int], input_splits: list[int], phase: str
    ) -> torch.Tensor:
        tensor = tensor.to(self.device).contiguous()
        output = tensor.new_empty(sum(output_splits), *tensor.shape[1:])
        self._collective(
            phase, dist.all_to_all_single, output, tensor, output_splits, input_splits, group=self.group
        )
        return output

    def _all_gather(self, tensor: torch.Tensor, phase: str) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._collective(phase, dist.all_gather, parts, tensor, group=self.group)
        return torch.cat(parts)

    def _all_reduce(self, tensor: torch.Tensor, phase: str) -> None:
        self._collective(phase, dist.all_reduce, tensor, group=self.group)

    def _collective(self, phase: str, operation, *args, **kwargs) -> None:
        try:
            operation(*args, **kwargs)
        except RuntimeError as error:  # gloo and NCCL raise RuntimeError subclasses
            raise ShardingError(
                f"rank {self.rank}: the process group failed {phase} ({error}); this rank's store "
                f"holds its last flush: restart every rank from it"
            ) from error
