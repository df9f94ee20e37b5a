"""Canonical KV caches: one byte-level view of whatever KV tensors an engine registers.

Worker process (the one that owns the KV tensors).
"""

from hybridkv.layout.canonical import (
    BlockSpan,
    CanonicalKVCaches,
    KVLayoutKind,
    PageRef,
    canonicalize,
)

__all__ = [
    "BlockSpan",
    "CanonicalKVCaches",
    "KVLayoutKind",
    "PageRef",
    "canonicalize",
]
