"""A model's KV cache groups: layers of one kind and block size, the kinds and their rules.

Pure data and pure functions; used by the scheduler side and the worker side.
"""

from hybridkv.groups.kinds import GroupKind
from hybridkv.groups.model_groups import KVGroup, ModelGroups, make_layer_names, merge_stages

__all__ = ["GroupKind", "KVGroup", "ModelGroups", "make_layer_names", "merge_stages"]
