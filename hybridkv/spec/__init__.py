"""The KV cache model: groups of layers, their kinds and the rules of each kind.

Pure data and pure functions; used by the scheduler side and the worker side.
"""

from hybridkv.spec.groups import GroupKind, KVGroup, KVLayoutSpec, make_layer_names

__all__ = ["GroupKind", "KVGroup", "KVLayoutSpec", "make_layer_names"]
