"""The KV cache model: groups of layers, their kinds and the rules of each kind.

Pure data and pure functions; used by the scheduler side and the worker side.
"""

from hybridkv.spec.groups import KVGroup, KVLayoutSpec, make_layer_names
from hybridkv.spec.kinds import GroupKind

__all__ = ["GroupKind", "KVGroup", "KVLayoutSpec", "make_layer_names"]
