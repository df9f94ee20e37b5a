"""Canonical KV caches: one byte-level view of whatever KV tensors an engine registers.

Worker process (the one that owns the KV tensors).
"""

from hybridkv.layout.allocate import AllocatedKVCaches, allocate_kv_caches
from hybridkv.layout.canonical import (
    BlockSpan,
    CanonicalKVCaches,
    KVLayoutKind,
    PageRef,
    canonicalize,
)

__all__ = [
    "AllocatedKVCaches",
    "BlockSpan",
    "CanonicalKVCaches",
    "KVLayoutKind",
    "PageRef",
    "allocate_kv_caches",
    "canonicalize",
]
