"""Which bytes a pending verify is charged against a byte budget (ARCHITECTURE "Which bytes a demand is charged").

Owns the charge modes, the expert-set arithmetic behind marginal charges (sets as int
bitmasks over one byte map, counted one union at a time; many unions at once as rows of
packed 64-bit words), the resident set's mask as it drifts (`TrackedRow`), the lazy union of
several sets (`UnionOf`) and the largest union a block can route (the byte cap's liveness
bound). Pure arithmetic over the byte map, resident and in-flight sets it is
handed; it never reads the cache itself.
"""

from __future__ import annotations

import enum
import functools
import operator
from collections import defaultdict
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence, Set
from typing import Protocol, cast

import numpy as np
import numpy.typing as npt

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


Rows = npt.NDArray[np.uint64]  # [n, words]: one set of experts per row, bit i = the byte map's i-th expert


class UnionOf(Set[ExpertKey]):
    """The union of several sets, not built: a batch's in-flight union costs no set building,
    and a tick ors the rows it already holds for registered parts (pdflash.engine.demand_table)."""

    def __init__(self, parts: Iterable[Set[ExpertKey]]) -> None:
        self.parts = tuple(parts)

    @functools.cached_property
    def _union(self) -> frozenset[ExpertKey]:
        return frozenset().union(*self.parts)

    def __contains__(self, expert: object) -> bool:
        return any(expert in part for part in self.parts)

    def __iter__(self) -> Iterator[ExpertKey]:
        return iter(self._union)

    def __len__(self) -> int:
        return len(self._union)

    def __bool__(self) -> bool:  # without building the union
        return any(self.parts)


class ExpertMasks:
    """Sets of experts as bits over one byte map: int masks (`mask`, `nbytes`), the form a tick
    charges in, and rows of packed 64-bit words (`row`, `row_of`, `row_bytes`), the form many
    unions are counted in at once (`marginal_charges`, the pure charge function).

    As sets, charging one pending union is a set difference over its experts (about 75 ms per
    tick for 256 Qwen3-30B-A3B-sized unions of ~2,500 experts on one CPU core). As masks, a
    union is built once, when its verify is registered, and a tick charges each one it reads
    in a few big-int operations (`MarginalCounter`; bench_admission.py times it).
    """

    SMALL = 64  # experts up to which or-ing single bits beats numpy's fixed cost

    def __init__(self, byte_map: Mapping[ExpertKey, int]) -> None:
        self.byte_map = byte_map
        self.bit = {expert: i for i, expert in enumerate(byte_map)}  # expert -> its bit
        self.grid = _grid_of(list(byte_map))  # (experts per layer, first layer) when bits are arithmetic
        self._single = {expert: 1 << i for expert, i in self.bit.items()}
        self.words = max(1, -(-len(byte_map) // 64))  # 64-bit words per row
        by_size: dict[int, list[ExpertKey]] = defaultdict(list)
        for expert, size in byte_map.items():
            by_size[size].append(expert)
        self._sizes = tuple((size, self.mask(experts)) for size, experts in by_size.items())
        self.one_size = self._sizes[0][0] if len(self._sizes) == 1 else None  # bytes of every expert, if one size
        self.everything = (1 << len(byte_map)) - 1  # the mask of every expert
        self._size_bytes = np.array([size for size, _ in self._sizes], dtype=np.int64)  # [classes] bytes
        self._size_rows = np.stack([self.row(members) for _, members in self._sizes])  # [classes, words]

    def mask(self, experts: Collection[ExpertKey]) -> int:
        """The mask of `experts`; KeyError for an expert the byte map lacks."""
        if len(experts) <= self.SMALL:  # 3 µs for 36 experts, against 4 µs through numpy
            return functools.reduce(operator.or_, map(self._single.__getitem__, experts), 0)
        flags = np.zeros(len(self.bit), dtype=bool)
        flags[np.fromiter(map(self.bit.__getitem__, experts), dtype=np.int64)] = True
        return int.from_bytes(np.packbits(flags, bitorder="little").tobytes(), "little")

    def nbytes(self, mask: int) -> int:
        """Σ of the byte map over the experts in `mask`."""
        if self.one_size is not None:
            return self.one_size * mask.bit_count()
        return sum(size * (mask & members).bit_count() for size, members in self._sizes)

    def row(self, mask: int) -> Rows:
        """`mask` as one row of packed little-endian 64-bit words: [words]."""
        return np.frombuffer(mask.to_bytes(8 * self.words, "little"), dtype="<u8").astype(np.uint64)

    def row_of(self, experts: Collection[ExpertKey]) -> Rows:
        """The row of `experts` ([words]) without an int mask between; KeyError for an expert the byte map lacks."""
        flags = np.zeros(64 * self.words, dtype=bool)
        flags[self.bits(experts)] = True
        return packed(flags)

    def bits(self, experts: Collection[ExpertKey]) -> npt.NDArray[np.intp] | list[int]:
        """[len(experts)] the bit of each expert; KeyError for an expert the byte map lacks.

        A byte map laid out as a grid (every expert of consecutive layers, layer by layer: the
        models' own) numbers its experts by arithmetic: with cold caches (a forward ran since
        the last tick) a dict lookup per expert costs about 3x as much."""
        if self.grid is not None and experts:
            per_layer, first = self.grid
            bits = [(layer - first) * per_layer + e if 0 <= e < per_layer else -1 for layer, e in experts]
            if min(bits) >= 0 and max(bits) < len(self.bit):
                return bits
        return np.fromiter(map(self.bit.__getitem__, experts), dtype=np.intp, count=len(experts))

    def row_bytes(self, rows: Rows) -> npt.NDArray[np.int64]:
        """[n] Σ of the byte map over each row's experts (rows: [n, words])."""
        if len(self._sizes) == 1:
            return self._popcounts(rows) * self._size_bytes[0]
        per_class = [self._popcounts(rows & members) for members in self._size_rows]  # [classes][n]
        return np.stack(per_class, axis=1) @ self._size_bytes

    def _popcounts(self, rows: Rows) -> npt.NDArray[np.int64]:
        counts = np.bitwise_count(rows)  # [n, words] <= 64
        total = np.uint16 if self.words < 1024 else np.int64  # a row's popcount fits 16 bits: faster sums
        return counts.sum(axis=1, dtype=total).astype(np.int64)


def _grid_of(experts: list[ExpertKey]) -> tuple[int, int] | None:
    """(experts per layer, first layer) if `experts` are the (layer, expert) int pairs of every
    expert of consecutive layers, layer by layer, expert by expert; None otherwise."""
    if not all(type(k) is tuple and len(k) == 2 and type(k[0]) is int and type(k[1]) is int for k in experts):
        return None
    first, per_layer = (experts[0][0], 1 + max(e for _, e in experts)) if experts else (0, 1)
    grid = all(k == (first + i // per_layer, i % per_layer) for i, k in enumerate(experts))
    return (per_layer, first) if experts and len(experts) % per_layer == 0 and grid else None


def packed(flags: npt.NDArray[np.bool_]) -> Rows:
    """[words] the row of `flags` ([64 * words] bools, one per bit)."""
    return np.packbits(flags, bitorder="little").view("<u8").astype(np.uint64)


class GridMasked(Protocol):
    """A set that also comes as a bitmask over bit layer * experts_per_layer + expert (the device
    cache's `slot_table.ResidentKeys` snapshots, whose table keeps it as experts come and go)."""

    mask: int  # the set's experts, bit layer * experts_per_layer + expert
    experts_per_layer: int


class TrackedRow:
    """The int mask (and row) of a set that drifts between calls (the resident experts). A
    `GridMasked` set numbered as a grid byte map numbers its experts is read as one int, shifted;
    any other set is kept by its differences from the last one (two set differences over every
    resident expert, about 40 µs for 1,536 of them with cold caches, and a pack)."""

    def __init__(self, masks: ExpertMasks) -> None:
        self._masks = masks
        self._set: Set[ExpertKey] | None = frozenset()  # the last set, unless it came as a mask
        self._flags = np.zeros(64 * masks.words, dtype=bool)  # [64 * words] one per bit, for the differences
        self._mask = 0

    def of(self, experts: Set[ExpertKey]) -> Rows:
        """[words] the row of `experts`."""
        return self._masks.row(self.mask_of(experts))

    def mask_of(self, experts: Set[ExpertKey]) -> int:
        """The int mask of `experts` (`ExpertMasks.mask`)."""
        if experts is self._set:
            return self._mask
        grid = self._masks.grid
        if grid is not None and getattr(experts, "experts_per_layer", None) == grid[0]:
            # layers outside the byte map's hold no expert a union can name: shifted or cut off
            self._mask = (cast(GridMasked, experts).mask >> (grid[1] * grid[0])) & self._masks.everything
            self._set = None  # the flags are stale now: the next plain set rebuilds them whole
            return self._mask
        if self._set is None or 2 * len(came := experts - self._set) + len(self._set) >= 2 * len(experts):
            self._flags[:] = False  # rebuilt whole: cheaper than the differences (|came| + |went| >= |experts|)
            self._flags[self._masks.bits(experts)] = True
        else:
            self._flags[self._masks.bits(self._set - experts)] = False
            self._flags[self._masks.bits(came)] = True
        self._mask = int.from_bytes(np.packbits(self._flags, bitorder="little").tobytes(), "little")
        self._set = experts if type(experts) is frozenset else frozenset(experts)
        return self._mask


def marginal_charges(masks: ExpertMasks, stacked: Rows) -> npt.NDArray[np.int64]:
    """[n] bytes each of rows 1..n of `stacked` ([n + 1, words]) adds to row 0 and the rows before it.

    Row 0 is what is already covered (resident ∪ in flight), rows 1..n the pending unions in
    admission order: charge i = bytes(row 0 | ... | row i) - bytes(row 0 | ... | row i-1).
    Overwrites `stacked` with those running ors (its last row: all of it).
    """
    np.bitwise_or.accumulate(stacked, axis=0, out=stacked)
    return np.diff(masks.row_bytes(stacked))


class MarginalCounter:
    """`marginal_charges` one union at a time, over int masks: each union is charged the bytes it
    adds to `covered` and to every union counted before it (admitted or not). A tick counts only
    as far down its line as first-fit reads, and after a forward has run in between (cold
    caches) a few big-int operations per union cost less than any numpy pass over the line."""

    def __init__(self, masks: ExpertMasks, covered: int) -> None:
        self._masks, self._size = masks, masks.one_size
        self._uncovered = masks.everything & ~covered  # experts neither covered nor counted yet

    def __call__(self, mask: int) -> int:
        """Bytes of `mask` not covered nor counted; they count from now on."""
        new = mask & self._uncovered
        if not new:
            return 0
        self._uncovered ^= new
        return self._size * new.bit_count() if self._size is not None else self._masks.nbytes(new)


def row_mask(row: Rows) -> int:
    """The int mask of one row ([words])."""
    return int.from_bytes(row.astype("<u8", copy=False).tobytes(), "little")


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
    stacked = np.stack([masks.row(m) for m in (covered, *unions)])  # [n + 1, words]
    return marginal_charges(masks, stacked).tolist()


def largest_block_union_bytes(byte_map: Mapping[ExpertKey, int], block_tokens: int, top_k: int) -> int:
    """Bytes of the largest union `block_tokens` tokens can route: per MoE layer, its
    min(block_tokens x top_k, experts) largest experts (exact byte-map sums, no averages)."""
    per_layer: dict[int, list[int]] = defaultdict(list)
    for (layer, _), nbytes in byte_map.items():
        per_layer[layer].append(nbytes)
    return sum(sum(sorted(sizes, reverse=True)[: block_tokens * top_k]) for sizes in per_layer.values())
