"""Settings of the cache tiers, as one small frozen dataclass shared by ``TieredStore`` and the
modules (a store's row layout is ``metadata.StoreMetadata``)."""

from __future__ import annotations

import dataclasses
import math

from ..budget import Budget, check_budget, horizon_accesses
from ..validation import integral
from .backends import check_setting
from .policies import EvictionPolicy


@dataclasses.dataclass(frozen=True)
class TierConfig:
    """Budgets and backends of the cache tiers.

    host_cache, device_cache: bytes (``"64MiB"``), a share of the tier's memory (``"10%"``: of RAM
        for the host tier, of the GPU's memory for the device tier) or a row count; ``0``/``None``
        leaves the tier out. At least one cache tier is needed.
    host_cache_backend: "openmp" (the kernels compiled for the CPU), "torch" (torch ops), "auto" (the
        kernels where g++ builds them), or a backend value (``tierstore.tiers.backends``). The mmap
        cold store's key indexes follow it (kernel hash tables unless "torch").
    device_cache_backend: "cuda" (the kernels on the GPU: a CUDA device, cuda-python, NVRTC;
        float32, float16 or bfloat16 rows), "torch", "auto" (the kernels where they can run), or a
        backend value.
    half_life: LFU ageing, in accesses per tier (inf: plain LFU; default: chosen online by shadow
        caches, ``tiers.ageing``).
    policy: the cache tiers' eviction policy, an ``tiers.policies.EvictionPolicy`` subclass
        (default ``None``: LFU with ageing at ``half_life``).
    horizon: a lookahead horizon (``prefetch(horizon=)``: row lookups, or ``"10x"`` the top tier's
        capacity) whose memory the top tier's byte budget holds beside its rows: the tier takes
        ``budget.horizon_nbytes`` less, and a horizon on this store reads no further ahead than
        that memory allows. None: nothing reserved (a horizon's memory is then outside the budget).
    """

    host_cache: Budget = "256MiB"
    device_cache: Budget = None
    host_cache_backend: object = "auto"
    device_cache_backend: object = "auto"
    half_life: float | None = None
    policy: type[EvictionPolicy] | None = None
    horizon: int | str | None = None

    def __post_init__(self) -> None:
        """Every setting is checked here, so a bad one is refused before anything is created."""
        for name in ("host_cache", "device_cache"):
            object.__setattr__(self, name, integral(getattr(self, name)))  # numpy ints, 0-d tensors
            check_budget(getattr(self, name), name)
        check_setting("host", self.host_cache_backend)
        check_setting("device", self.device_cache_backend)
        half_life = self.half_life
        if half_life is not None and (
            isinstance(half_life, bool)
            or not isinstance(half_life, (int, float))
            or math.isnan(half_life)
            or half_life <= 0
        ):
            raise ValueError(
                f"half_life must be a positive number of accesses (inf: no ageing) or None, got {half_life!r}"
            )
        if self.horizon is not None:
            horizon_accesses(self.horizon, 1)  # raises naming the horizon
        if self.policy is not None and not (
            isinstance(self.policy, type) and issubclass(self.policy, EvictionPolicy)
        ):
            raise TypeError(
                f"policy must be a subclass of tierstore.tiers.EvictionPolicy or None, got {self.policy!r}"
            )

    @classmethod
    def from_settings(cls, config: TierConfig | None, settings: dict) -> TierConfig:
        """``config`` (default ``TierConfig()``) with ``settings`` (keyword arguments of its fields)
        replaced; raises ``TypeError`` naming an unknown keyword and the known ones."""
        fields = [field.name for field in dataclasses.fields(cls)]
        if config is not None and not isinstance(config, cls):
            raise TypeError(
                f"tiers must be a tierstore.TierConfig or None, got {type(config).__name__} {config!r:.60}; "
                f"pass tiers=TierConfig(...), or its fields ({', '.join(fields)}) as keywords"
            )
        unknown = sorted(set(settings) - set(fields))
        if unknown:
            raise TypeError(
                f"unexpected keyword argument(s) {', '.join(map(repr, unknown))}; the cache tiers' "
                f"settings are {', '.join(fields)}"
            )
        return dataclasses.replace(config or cls(), **settings)
