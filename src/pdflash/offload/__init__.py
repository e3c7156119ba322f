"""Expert offloading: host store → prefetch lane → byte-budgeted device cache, as an ExpertProvider."""

from pdflash.offload.cache_stats import OffloadStats
from pdflash.offload.device_cache import ExpertClaim, ExpertFetchError, OffloadedExperts
from pdflash.offload.eviction import POLICIES, make_policy
from pdflash.offload.host_store import HostExpert, HostExpertStore
from pdflash.offload.link import Link
from pdflash.offload.prefetch import PrefetchLane, Priority
from pdflash.offload.target import load_offloaded_target

__all__ = [
    "POLICIES",
    "ExpertClaim",
    "ExpertFetchError",
    "HostExpert",
    "HostExpertStore",
    "Link",
    "OffloadStats",
    "OffloadedExperts",
    "PrefetchLane",
    "Priority",
    "load_offloaded_target",
    "make_policy",
]
