"""hybridkv: offload and share the KV cache of hybrid-attention LLMs."""

from hybridkv.groups import GroupKind, KVGroup, ModelGroups

__all__ = ["GroupKind", "KVGroup", "ModelGroups"]
__version__ = "0.1.0"
