"""hybridkv: offload and share the KV cache of hybrid-attention LLMs."""

from hybridkv.spec import GroupKind, KVGroup, KVLayoutSpec

__all__ = ["GroupKind", "KVGroup", "KVLayoutSpec"]
__version__ = "0.1.0"
