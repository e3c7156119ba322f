"""The device cache's resident snapshots carry the slot table's bitmask: a tick's tracked row,
read from it through real fetches and evictions, is the mask of the resident set."""

from __future__ import annotations

import random

import torch

from pdflash.engine.charging import ExpertMasks, TrackedRow
from pdflash.offload import HostExpertStore, OffloadedExperts
from pdflash.offload.slot_table import ResidentKeys
from pdflash.target.checkpoint import Checkpoint, expert_byte_map
from pdflash.target.config import ModelConfig


def test_a_tracked_row_reads_the_cache_through_fetches_and_evictions(tiny_target):
    config = ModelConfig.from_file(tiny_target / "config.json")
    checkpoint = Checkpoint(tiny_target)
    store = HostExpertStore(checkpoint, config)
    byte_map = expert_byte_map(checkpoint, config)
    provider = OffloadedExperts(store, config, dtype=torch.float32, expert_cache_bytes=6 * store.nbytes((1, 0)))
    masks = ExpertMasks(byte_map)
    assert masks.grid == (config.num_experts, config.moe_layer_ids[0])  # read as one int, not key by key
    tracked = TrackedRow(masks)
    rng = random.Random(0)
    try:
        for _ in range(12):
            layer = rng.choice(config.moe_layer_ids)
            list(provider.waves(layer, rng.sample(range(config.num_experts), 3)))  # misses evict
            snapshot = provider.resident()
            assert isinstance(snapshot, ResidentKeys) and len(snapshot) <= provider.num_slots
            assert tracked.mask_of(snapshot) == masks.mask(frozenset(snapshot))
    finally:
        provider.close()
