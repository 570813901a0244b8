"""Where a sharded table's rows live: each rank's store under the table's path, the replicated
keys recorded beside them, and each rank's record of its last collective flush (``RowSharding``'s part)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..metadata import METADATA_FILE, RANK_DIRECTORY, write_json_atomic
from ..validation import as_ids
from ..warm_start import hot_ids
from .replication import measure_bandwidths, plan_replication

REPLICATED_FILE = "replicated.npy"  # beside the ranks' stores: the keys every rank holds


def replicated_keys(replicate: Any, warm: Any) -> torch.Tensor | None:
    """The keys ``replicate`` names (None: none asked for): ids or a ``.npy`` of them, or an int N,
    the N first of the ``warm`` ranking."""
    if replicate is None:
        return None
    if isinstance(replicate, int) and not isinstance(replicate, bool):
        if replicate < 0:
            raise ValueError(
                f"replicate must be a count of at least 0 rows, ids or a .npy of them, got {replicate}"
            )
        if replicate and warm is None:
            raise ValueError(
                f"replicate={replicate} takes the {replicate} hottest ids of the warm= ranking, and none was "
                f"given: pass warm= a ranking ('tierstore profile --out' writes one), or replicate= the ids"
            )
        return hot_ids(warm)[:replicate] if replicate else torch.zeros(0, dtype=torch.int64)
    return hot_ids(replicate)


class ShardPlacement:
    """``RowSharding``'s stores, replicated keys and flush records on disk."""

    def store_path(self, path: str | Path | None, requested: torch.Tensor | None) -> Path | None:
        """This rank's store under ``path`` (``rank<r>-of-<world>``; None: a temporary store), and
        the replicated keys: ``requested`` (recorded in ``REPLICATED_FILE`` on first use), or
        the recorded ones when None. A table written by another number of ranks, with other
        replicated keys, or whose last collective flush did not complete, is refused."""
        self.replicated = torch.zeros(0, dtype=torch.int64) if requested is None else torch.unique(requested)
        if path is None:
            return None
        root = Path(path)
        if (root / METADATA_FILE).exists():
            raise ValueError(
                f"{root} holds a store of one process; a sharded table keeps one store per rank "
                f"under its path: give it another path"
            )
        worlds = {
            int(match.group(2))
            for match in map(RANK_DIRECTORY.fullmatch, os.listdir(root) if root.is_dir() else [])
            if match
        }
        if worlds - {self.world_size}:
            raise ValueError(
                f"{root} holds a table sharded over {sorted(worlds)[0]} ranks, and this process group has "
                f"{self.world_size}: open it with {sorted(worlds)[0]} ranks (resharding to another number "
                f"of ranks is not built yet)"
            )
        root.mkdir(parents=True, exist_ok=True)
        self.replicated_record = root / REPLICATED_FILE
        if self.replicated_record.exists():
            recorded = torch.from_numpy(np.load(self.replicated_record, allow_pickle=False))
            if requested is not None and not torch.equal(recorded, self.replicated):
                raise ValueError(
                    f"{root} replicates {recorded.numel()} other keys than replicate= names "
                    f"({self.replicated.numel()}): replicas are only kept alike for the keys they were "
                    f"made with; leave replicate= out to use the recorded ones"
                )
            self.replicated, self.recorded = recorded, True
        elif requested is not None:
            self._record_replicated()
        self.flush_record = root / f"rank{self.rank}-of-{self.world_size}.json"
        if self.flush_record.exists():
            last = json.loads(self.flush_record.read_text())
            if not last["complete"]:
                raise ValueError(
                    f"{root}: the collective flush of step {last['step']} did not complete on every rank "
                    f"(a rank died during it), so the ranks' stores may hold different flushes. To train "
                    f"on from them as they are, remove {root}/rank*-of-{self.world_size}.json"
                )
        return root / f"rank{self.rank}-of-{self.world_size}"

    def _record_replicated(self) -> None:
        partial = self.replicated_record.with_name(f".{REPLICATED_FILE}.rank{self.rank}")
        with open(partial, "wb") as file:  # every rank writes the same keys: the last rename wins
            np.save(file, self.replicated.numpy())
        os.replace(partial, self.replicated_record)

    def choose_replicated(self, access_sample: Any, dim: int, max_rows: int) -> None:
        """``replicate="auto"``: the replicated keys ``plan_replication`` picks from rank 0's
        ``access_sample`` (its first batches of keys) and the bandwidths measured on the group,
        replicating at most ``max_rows`` rows; every rank takes rank 0's choice (collective)."""
        bandwidths = measure_bandwidths(self.group)
        choice = [None, None]
        if self.rank == 0:
            batches = [as_ids(batch, "access_sample").numpy() for batch in access_sample]
            sample = np.concatenate(batches) if batches else np.zeros(0, dtype=np.int64)
            batch_size = max(1, round(sample.size / max(len(batches), 1)))
            choice = list(plan_replication(sample, self.world_size, batch_size, dim, max_rows, bandwidths))
        dist.broadcast_object_list(choice, group=self.group, group_src=0)
        self.replicated, self.plan = (
            torch.unique(torch.from_numpy(np.asarray(choice[0], dtype=np.int64))),
            choice[1],
        )
        if self.replicated_record is not None:
            self._record_replicated()

    def flush(self, store, step: int) -> None:
        """Every rank commits its store, recording ``step`` (the table's optimizer steps) as begun,
        then as complete once every rank has committed."""
        if self.flush_record is not None:
            write_json_atomic(self.flush_record, {"step": step, "complete": False})
        self.together("flush", store.flush)
        if self.flush_record is not None:
            write_json_atomic(self.flush_record, {"step": step, "complete": True})

    def last_flushed_step(self) -> int:
        """The step this rank's last complete collective flush recorded (0: none)."""
        if self.flush_record is None or not self.flush_record.exists():
            return 0
        return int(json.loads(self.flush_record.read_text())["step"])
