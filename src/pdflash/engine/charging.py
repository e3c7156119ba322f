"""Which bytes a pending verify is charged against a byte budget (ARCHITECTURE "Which bytes a demand is charged").

Owns the charge modes, the expert-set arithmetic behind marginal charges (sets as int
bitmasks over one byte map) and the largest union a block can route (the byte cap's
liveness bound). Pure arithmetic over the byte map, resident and in-flight sets it is
handed; it never reads the cache itself.
"""

from __future__ import annotations

import enum
import functools
import operator
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence, Set
from typing import Protocol

import numpy as np

from pdflash.target.experts import ExpertKey


class ChargeMode(enum.Enum):
    """How many bytes a pending verify is charged against the byte budget."""

    FULL = "full"  # every byte of its projected union, shared or not
    FETCH = "fetch"  # the part not resident when its route was projected (as registered)
    MARGINAL = "marginal"  # the bytes its union adds to what is resident / coming / charged

    @classmethod
    def parse(cls, value: ChargeMode | str) -> ChargeMode:
        """The mode named by `value`; ValueError listing the valid names otherwise."""
        try:
            return cls(value)
        except ValueError:
            valid = ", ".join(repr(m.value) for m in cls)
            raise ValueError(f"charge_mode={value!r} is not one of {valid}") from None


class Chargeable(Protocol):
    @property
    def union(self) -> frozenset[ExpertKey]: ...  # projected routed union, (layer, expert) pairs
    @property
    def full_bytes(self) -> int: ...  # bytes: sum of the byte map over `union`
    @property
    def fetch_bytes(self) -> int: ...  # bytes of `union` not resident at projection time


class ExpertMasks:
    """Sets of experts as int bitmasks over one byte map: the marginal charge in big-int operations.

    As sets, charging one pending union is a set difference over its experts (about 75 ms per
    tick for 256 Qwen3-30B-A3B-sized unions of ~2,500 experts on one CPU core). As masks it is
    an and-not and one popcount per distinct expert size; a union becomes a mask once, when its
    verify is first charged (bench_admission.py times both parts).
    """

    SMALL = 64  # experts up to which or-ing single bits beats numpy's fixed cost

    def __init__(self, byte_map: Mapping[ExpertKey, int]) -> None:
        self.byte_map = byte_map
        self._bit = {expert: i for i, expert in enumerate(byte_map)}
        self._single = {expert: 1 << i for expert, i in self._bit.items()}
        by_size: dict[int, list[ExpertKey]] = defaultdict(list)
        for expert, size in byte_map.items():
            by_size[size].append(expert)
        self._sizes = tuple((size, self.mask(experts)) for size, experts in by_size.items())

    def mask(self, experts: Collection[ExpertKey]) -> int:
        """The mask of `experts`; KeyError for an expert the byte map lacks."""
        if len(experts) <= self.SMALL:  # 3 µs for 36 experts, against 4 µs through numpy
            return functools.reduce(operator.or_, map(self._single.__getitem__, experts), 0)
        flags = np.zeros(len(self._bit), dtype=bool)
        flags[np.fromiter(map(self._bit.__getitem__, experts), dtype=np.int64)] = True
        return int.from_bytes(np.packbits(flags, bitorder="little").tobytes(), "little")

    def nbytes(self, mask: int) -> int:
        """Σ of the byte map over the experts in `mask`."""
        return sum(size * (mask & members).bit_count() for size, members in self._sizes)


def alone_bytes(
    masks: ExpertMasks, union_masks: Sequence[int], resident: Set[ExpertKey], in_flight: Set[ExpertKey]
) -> list[int]:
    """Bytes each union adds to resident ∪ in flight on its own (not cumulative: the ordering's key)."""
    covered = masks.mask(resident) | masks.mask(in_flight)
    return [masks.nbytes(union & ~covered) for union in union_masks]


def charge_bytes(
    pending: Sequence[Chargeable],
    mode: ChargeMode | str,
    byte_map: Mapping[ExpertKey, int] | ExpertMasks | None,
    resident: Set[ExpertKey],
    in_flight: Set[ExpertKey],
    *,
    union_masks: Sequence[int] | None = None,
) -> list[int]:
    """Bytes to charge each pending verify, in the order given (the admission order).

    MARGINAL charges item i the byte map summed over
        union_i - resident - in_flight - (union_0 | ... | union_{i-1}).
    ARCHITECTURE asks for the unions *admitted* this tick, but charges are needed before
    admission, so this charges against every earlier candidate, admitted or not. The error
    is one-sided: when an earlier candidate is skipped, a later one that shares its experts
    is undercharged by exactly those shared bytes, so a tick may move more bytes than its
    budget by at most what admitted demands share with skipped ones ahead of them; that
    excess is never charged to a later tick either.

    `byte_map` may be given as its `ExpertMasks` (built once by its owner), and the pending
    unions as masks of it (`union_masks`), so a tick builds neither again.
    """
    mode = ChargeMode.parse(mode)
    if mode is ChargeMode.FULL:
        return [p.full_bytes for p in pending]
    if mode is ChargeMode.FETCH:
        return [p.fetch_bytes for p in pending]
    if byte_map is None:
        raise ValueError("charge mode 'marginal' needs the byte map; got byte_map=None")
    masks = byte_map if isinstance(byte_map, ExpertMasks) else ExpertMasks(byte_map)
    unions = union_masks if union_masks is not None else [masks.mask(p.union) for p in pending]
    covered = masks.mask(resident) | masks.mask(in_flight)
    charges = []
    for union in unions:
        new = union & ~covered
        charges.append(masks.nbytes(new))
        covered |= new
    return charges


def largest_block_union_bytes(byte_map: Mapping[ExpertKey, int], block_tokens: int, top_k: int) -> int:
    """Bytes of the largest union `block_tokens` tokens can route: per MoE layer, its
    min(block_tokens x top_k, experts) largest experts (exact byte-map sums, no averages)."""
    per_layer: dict[int, list[int]] = defaultdict(list)
    for (layer, _), nbytes in byte_map.items():
        per_layer[layer].append(nbytes)
    return sum(sum(sorted(sizes, reverse=True)[: block_tokens * top_k]) for sizes in per_layer.values())
