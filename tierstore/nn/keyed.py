"""TorchRec-shaped inputs and outputs of the multi-table collection: ``EmbeddingBagConfig`` (a
table), ``KeyedJaggedTensor`` (a batch of variable-length id lists per feature) and
``KeyedTensor`` (the pooled embeddings per feature). Names, argument order and layout follow
TorchRec, so code ports by changing imports; TorchRec's own objects are accepted where these are
(duck-typed: ``keys()``, ``values()``, ``lengths()``/``offsets()``, ``weights_or_none()``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any

import numpy as np
import torch

from ..validation import check_table_shape, cpu_int64

POOLINGS = ("sum", "mean")


@dataclasses.dataclass(frozen=True)
class EmbeddingBagConfig:
    """One table: ``num_embeddings`` (``None``: any id below 2**47, growing on demand),
    ``embedding_dim``, a unique ``name``, the ``feature_names`` looked up in it, and its
    ``pooling`` ("sum" or "mean"; TorchRec's ``PoolingType`` is accepted too). The other fields
    are TorchRec's (by keyword, as its code passes them); those a tiered table cannot honour must
    keep their defaults (``UNSUPPORTED_FIELDS`` says why)."""

    num_embeddings: int | None
    embedding_dim: int
    name: str = ""
    feature_names: tuple[str, ...] | list[str] = ()
    pooling: Any = "sum"
    data_type: Any = "FP32"
    weight_init_max: float | None = None
    weight_init_min: float | None = None
    num_embeddings_post_pruning: int | None = None
    init_fn: Any = None
    need_pos: bool = False


# TorchRec's DataType names -> a table's row dtype (None: the collection's dtype=, float32 by default).
DATA_TYPES = {"FP32": None, "FP16": "float16", "BF16": "bfloat16"}

# A TorchRec config field -> (its default, why a tiered table keeps it), checked on every config.
# TorchRec's own configs fill weight_init_min/max and init_fn with its default initialisation:
# those are accepted (``_torchrecs_default_init``), and the rows start as every tiered row does.
UNSUPPORTED_FIELDS = {
    "weight_init_max": (None, "rows start uniform in +-1/sqrt(dim), a function of id and seed"),
    "weight_init_min": (None, "rows start uniform in +-1/sqrt(dim), a function of id and seed"),
    "init_fn": (None, "rows are made when first looked up, never as a whole weight to initialise"),
    "num_embeddings_post_pruning": (None, "tables are not pruned"),
    "need_pos": (False, "positions are not passed to tables"),
    "use_virtual_table": (False, "every tiered table is already a virtual table"),
    "total_num_buckets": (None, "tables are not bucketised"),
}


def table_settings(config: Any) -> tuple[str, int | None, int, tuple[str, ...], str, str | None]:
    """``(name, num_embeddings, embedding_dim, feature_names, pooling, data_type)`` of an
    ``EmbeddingBagConfig`` or TorchRec's, checked; errors name the table and the field.
    ``data_type``: "float16" or "bfloat16" (``DataType.FP16``/``BF16``), None for FP32 (the
    collection's ``dtype=``)."""
    name = getattr(config, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"every table needs a non-empty str name, got {name!r}")
    num_embeddings, dim = config.num_embeddings, config.embedding_dim
    check_table_shape(num_embeddings, dim, name)
    if isinstance(config.feature_names, str):
        raise TypeError(
            f"table {name!r}: feature_names must be a list of str, got the str {config.feature_names!r} "
            f"(it would be split into letters); write [{config.feature_names!r}]"
        )
    features = tuple(config.feature_names)
    if not features or not all(isinstance(feature, str) and feature for feature in features):
        raise ValueError(f"table {name!r}: feature_names must be a non-empty list of str, got {features!r}")
    pooling = config.pooling
    pooling = str(getattr(pooling, "name", pooling)).lower()
    if pooling not in POOLINGS:
        raise ValueError(f"table {name!r}: pooling must be one of {POOLINGS}, got {config.pooling!r}")
    initialisation = {"weight_init_max", "weight_init_min", "init_fn"}
    for field, (default, reason) in UNSUPPORTED_FIELDS.items():
        if field in initialisation and _torchrecs_default_init(config):
            continue
        value = getattr(config, field, default)
        if value is not default and value != default:
            raise ValueError(
                f"table {name!r}: {field}={value!r} is not supported ({reason}); leave it {default!r}"
            )
    data_type = getattr(config, "data_type", "FP32")
    label = str(getattr(data_type, "name", data_type)).upper()
    if label not in DATA_TYPES:
        raise ValueError(
            f"table {name!r}: data_type={data_type!r} is not supported: rows are trained, so they are "
            f"floats: use one of {', '.join(DATA_TYPES)} (FP32: the collection's dtype=)"
        )
    return name, num_embeddings, dim, features, pooling, DATA_TYPES[label]


def _torchrecs_default_init(config: Any) -> bool:
    """Whether ``config``'s initialisation fields are the ones TorchRec's configs fill in by
    default: ``init_fn`` uniform in +-sqrt(1 / num_embeddings), the bounds unset or those."""
    init = getattr(config, "init_fn", None)
    if not isinstance(init, functools.partial) or init.func is not torch.nn.init.uniform_ or init.args:
        return False
    if not config.num_embeddings or set(init.keywords) != {"a", "b"}:
        return False
    bound = math.sqrt(1 / config.num_embeddings)
    high, low = getattr(config, "weight_init_max", None), getattr(config, "weight_init_min", None)
    return (
        math.isclose(init.keywords["b"], bound)
        and math.isclose(init.keywords["a"], -bound)
        and (high is None or math.isclose(high, bound))
        and (low is None or math.isclose(low, -bound))
    )


class KeyedJaggedTensor:
    """A batch of id lists per feature, laid out as TorchRec's: ``values`` holds every id, feature
    by feature and, within a feature, sample by sample; ``lengths [len(keys) * batch]`` says how
    many ids each (feature, sample) has (or ``offsets``, their running sum with a leading 0);
    ``weights`` (as ``values``) makes weighted bags."""

    def __init__(
        self,
        keys: list[str],
        values: torch.Tensor,
        weights: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
    ) -> None:
        if lengths is None and offsets is None:
            raise ValueError("KeyedJaggedTensor needs lengths or offsets")
        self._keys = _feature_names(keys)
        self._values = values
        self._weights = weights
        self._offsets = offsets
        self._lengths = lengths if lengths is not None else offsets[1:] - offsets[:-1]

    @classmethod
    def from_lengths_sync(cls, keys, values, lengths, weights=None) -> KeyedJaggedTensor:
        return cls(keys, values, weights=weights, lengths=lengths)

    @classmethod
    def from_offsets_sync(cls, keys, values, offsets, weights=None) -> KeyedJaggedTensor:
        return cls(keys, values, weights=weights, offsets=offsets)

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    def lengths(self) -> torch.Tensor:
        return self._lengths

    def lengths_or_none(self) -> torch.Tensor:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        if self._offsets is not None:
            return self._offsets
        return torch.cat([self._lengths.new_zeros(1), torch.cumsum(self._lengths, 0)])

    def offsets_or_none(self) -> torch.Tensor | None:
        """The offsets it was built from (None: built from lengths), as TorchRec's."""
        return self._offsets

    def stride(self) -> int:
        """The batch size: samples per feature."""
        return self._lengths.numel() // max(1, len(self._keys))


class KeyedTensor:
    """Pooled embeddings ``values [batch, sum of dims]``, features side by side in ``keys()``
    order along ``key_dim``, each ``length_per_key()`` wide (TorchRec's, method for method)."""

    def __init__(
        self,
        keys: list[str],
        length_per_key: list[int],
        values: torch.Tensor,
        key_dim: int = 1,
        offset_per_key: list[int] | None = None,
        index_per_key: dict[str, int] | None = None,
    ) -> None:
        self._keys = list(keys)
        self._length_per_key = list(length_per_key)
        self._values = values
        self._key_dim = key_dim
        self._offset_per_key = None if offset_per_key is None else list(offset_per_key)
        self._index_per_key = index_per_key

    @staticmethod
    def from_tensor_list(
        keys: list[str], tensors: list[torch.Tensor], key_dim: int = 1, cat_dim: int = 1
    ) -> KeyedTensor:
        """``tensors`` (one per key) concatenated along ``cat_dim``, each ``key_dim`` wide."""
        return KeyedTensor(
            keys, [tensor.shape[key_dim] for tensor in tensors], torch.cat(tensors, cat_dim), key_dim
        )

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def key_dim(self) -> int:
        return self._key_dim

    def device(self) -> torch.device:
        return self._values.device

    def length_per_key(self) -> list[int]:
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        """Where each key's columns start, and where the last ends (``len(keys()) + 1`` entries)."""
        if self._offset_per_key is None:
            self._offset_per_key = [0, *itertools.accumulate(self._length_per_key)]
        return self._offset_per_key

    def _key_indices(self) -> dict[str, int]:
        if self._index_per_key is None:
            self._index_per_key = {key: index for index, key in enumerate(self._keys)}
        return self._index_per_key

    def to_dict(self) -> dict[str, torch.Tensor]:
        """``{feature: [batch, dim]}`` (views of ``values()``)."""
        return dict(zip(self._keys, torch.split(self._values, self._length_per_key, dim=self._key_dim)))

    def __getitem__(self, key: str) -> torch.Tensor:
        index = self._key_indices()[key]
        start, end = self.offset_per_key()[index : index + 2]
        return self._values.narrow(self._key_dim, start, end - start)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KeyedTensor:
        values = self._values.to(device, non_blocking=non_blocking)
        return KeyedTensor(self._keys, self._length_per_key, values, self._key_dim, self._offset_per_key)

    def record_stream(self, stream: Any) -> None:
        self._values.record_stream(stream)

    def size_in_bytes(self) -> int:
        return self._values.numel() * self._values.element_size()

    @staticmethod
    def regroup(keyed_tensors: list[KeyedTensor], groups: list[list[str]]) -> list[torch.Tensor]:
        """Per group, its keys' columns (found in any of ``keyed_tensors``) side by side."""
        columns = {}
        for keyed in keyed_tensors:
            columns.update((key, keyed[key]) for key in keyed.keys() if key not in columns)
        missing = sorted({key for group in groups for key in group} - set(columns))
        if missing:
            raise KeyError(f"regroup: keys {missing} are in none of the KeyedTensors")
        dim = keyed_tensors[0].key_dim() if keyed_tensors else 1
        return [torch.cat([columns[key] for key in group], dim) for group in groups]

    @staticmethod
    def regroup_as_dict(
        keyed_tensors: list[KeyedTensor], groups: list[list[str]], keys: list[str]
    ) -> dict[str, torch.Tensor]:
        """``regroup``'s tensors, named by ``keys`` (one per group)."""
        if len(keys) != len(groups):
            raise ValueError(f"regroup_as_dict: {len(groups)} groups but {len(keys)} keys to name them")
        return dict(zip(keys, KeyedTensor.regroup(keyed_tensors, groups)))

    def __repr__(self) -> str:
        return (
            f"KeyedTensor(keys={self._keys}, length_per_key={self._length_per_key}, values={self._values!r})"
        )


def jagged_parts(features: Any) -> tuple[list[str], torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(keys, values int64 CPU [N], lengths int64 CPU [len(keys), batch], weights [N] or None)`` of
    a ``KeyedJaggedTensor`` (ours or TorchRec's), checked but for the lengths' values (the caller
    checks them: ``check_lengths``, or natively); each error names what is wrong."""
    if type(features) is KeyedJaggedTensor:  # ours, read directly: its keys were checked as it was built
        keys, values, weights = features._keys, features._values, features._weights
        offsets = features._offsets  # given offsets are checked as given
        lengths = features._lengths if offsets is None else None
    else:
        keys, values, offsets, lengths, weights = _foreign_parts(features)
    if len(set(keys)) != len(keys):
        raise ValueError(f"the KeyedJaggedTensor names a key twice: {keys}")
    _check_integers(values, "values", "ids")
    if offsets is not None:
        lengths = _checked_offsets(offsets, values.numel())
    _check_integers(lengths, "lengths", "bag lengths")
    lengths = cpu_int64(lengths)
    if keys and lengths.numel() % len(keys):
        raise ValueError(
            f"lengths holds {lengths.numel()} entries, not a multiple of the {len(keys)} keys "
            "(one per key and sample)"
        )
    if weights is not None and (
        not isinstance(weights, torch.Tensor)
        or not weights.is_floating_point()
        or weights.shape != values.shape
    ):
        raise ValueError(
            f"weights must be a floating-point tensor of values' shape {tuple(values.shape)}, "
            f"got {getattr(weights, 'shape', weights)}"
        )
    batch = lengths.numel() // len(keys) if keys else 0
    return keys, cpu_int64(values), lengths.view(len(keys), batch), weights


def _foreign_parts(features: Any) -> tuple[list[str], Any, Any, Any, Any]:
    """``(keys, values, offsets or None, lengths or None, weights or None)`` of a duck-typed
    ``KeyedJaggedTensor`` (TorchRec's), unchecked but for its methods and its keys."""
    jagged = all(callable(getattr(features, method, None)) for method in ("keys", "values")) and any(
        callable(getattr(features, method, None)) for method in ("lengths", "offsets")
    )
    if not jagged:
        raise TypeError(
            f"features must be a KeyedJaggedTensor (tierstore's or TorchRec's), got "
            f"{type(features).__name__}; build one with KeyedJaggedTensor.from_lengths_sync(keys, values, "
            "lengths)"
        )
    keys, values = _feature_names(features.keys()), features.values()
    offsets = _call(features, "offsets_or_none")
    lengths = None if offsets is not None else _call(features, "lengths")
    if offsets is None and lengths is None:
        offsets = features.offsets()
    return keys, values, offsets, lengths, _call(features, "weights_or_none")


def check_lengths(lengths: torch.Tensor, count: int) -> None:
    """``ValueError`` unless bag ``lengths`` (int64 CPU) are non-negative and sum to ``count``."""
    as_array = lengths.numpy()  # reduced on one thread: a batch's lengths are too few for a team
    if as_array.size and int(as_array.min()) < 0:
        raise lengths_problem(lengths, 1, int(np.flatnonzero(as_array.reshape(-1) < 0)[0]), count)
    if int(as_array.sum()) != count or (as_array.size and int(as_array.max()) > count):  # a sum may wrap
        raise lengths_problem(lengths, 2, min(sum(as_array.reshape(-1).tolist()), 2**63 - 1), count)


def lengths_problem(lengths: torch.Tensor, kind: int, detail: int, count: int) -> ValueError:
    """The error for bag ``lengths`` (int64) of ``count`` values found wrong: ``kind`` 1, the first
    negative one is at flat position ``detail``; 2, they sum to ``detail``."""
    if kind == 1:
        return ValueError(f"lengths must be non-negative, got {int(lengths.reshape(-1)[detail])}")
    return ValueError(f"lengths sum to {detail} but values holds {count} ids")


def _feature_names(keys: Any) -> list[str]:
    """``keys`` as a list of feature names; a bare str is refused (it would split into letters)."""
    names = None if isinstance(keys, str) else list(keys)
    if names is None or not all(map(isinstance, names, itertools.repeat(str))):  # C-level loops
        raise TypeError(f"keys must be a list of feature names (str), got {keys!r:.80}; e.g. [{keys!r:.40}]")
    return names


def _call(features: Any, method: str) -> Any:
    """``features.method()`` where it has that method, else None."""
    bound = getattr(features, method, None)
    return bound() if callable(bound) else None


def _check_integers(tensor: Any, name: str, what: str) -> None:
    """``TypeError`` naming ``name`` unless ``tensor`` is a 1-D tensor of integers (not bool)."""
    integer = isinstance(tensor, torch.Tensor) and not (
        tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool
    )
    if not integer or tensor.dim() != 1:
        raise TypeError(f"{name} must be a 1-D integer tensor of {what} (int64 or int32), got {tensor!r:.80}")


def _checked_offsets(offsets: Any, count: int) -> torch.Tensor:
    """The lengths of bags given by ``offsets`` (a leading 0, non-decreasing, ending at ``count``)."""
    _check_integers(offsets, "offsets", "bag starts")
    offsets = offsets.to(device="cpu", dtype=torch.int64)
    if offsets.numel() == 0 or int(offsets[0]) != 0 or int(offsets[-1]) != count:
        raise ValueError(
            "offsets must start at 0 and end at the number of values "
            f"({count}), one more entry than bags; got {offsets.tolist()[:8]}"
        )
    lengths = offsets[1:] - offsets[:-1]
    if lengths.numel() and int(lengths.numpy().min()) < 0:
        raise ValueError("offsets must be non-decreasing (bag i spans values[offsets[i]:offsets[i + 1]])")
    return lengths
