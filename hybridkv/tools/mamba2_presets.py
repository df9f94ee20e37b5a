"""Presets of Mamba2 + attention models: Granite 4.0-H and NemotronH.

Pure data for any process (``hybridkv.tools.presets`` registers them). Their Mamba
layers are vLLM's ``MambaMixer2``, which declares one prefill checkpoint block, so
hybridkv stores the states vLLM hands over by block id (not by position). As for
Qwen3-Next, vLLM grows the attention block until one attention page holds a
Mamba2 state, and with prefix caching ("align" mode) the Mamba block follows it;
the Mamba page is padded to the attention page.
"""

from __future__ import annotations

from hybridkv.groups import GroupKind, ModelGroups
from hybridkv.tools.preset_groups import (
    LayerKV,
    attention_block_size_for_state,
    attention_page_size_bytes,
    group_layers_like_vllm,
    mamba2_state_bytes,
)

GRANITE_4_0_H_TINY_STATE_BYTES = mamba2_state_bytes(
    num_heads=48, head_dim=64, n_groups=1, state_size=128, conv_kernel=4
)
"""806,400 bytes: conv (3072 + 2 x 128 channels x 3) + SSM (48 x 64 x 128) bf16 values."""
NEMOTRON_NANO_9B_V2_STATE_BYTES = mamba2_state_bytes(
    num_heads=128, head_dim=80, n_groups=8, state_size=128, conv_kernel=4
)
"""2,695,168 bytes: conv (10240 + 2 x 8 x 128 channels x 3) + SSM (128 x 80 x 128) bf16."""
NEMOTRON_NANO_9B_V2_PATTERN = "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"
"""``hybrid_override_pattern``: M a Mamba2 layer, * attention, - an MLP (no KV cache)."""


def _mamba2_and_attention(
    layer_kinds: list[str],
    *,
    state_bytes: int,
    num_kv_heads: int,
    head_dim: int,
    mamba_name: str,
    attention_name: str,
) -> list[tuple[str, LayerKV]]:
    """Each KV-holding layer (``M`` Mamba2, ``*`` attention) with its spec, in order."""
    per_token = attention_page_size_bytes(
        block_size=1, num_kv_heads=num_kv_heads, head_dim=head_dim
    )
    block_size = attention_block_size_for_state(
        state_bytes=state_bytes, attention_bytes_per_token=per_token
    )
    page = block_size * per_token
    mamba = LayerKV(kind=GroupKind.MAMBA, block_size=block_size, page_size_bytes=page)
    full = LayerKV(kind=GroupKind.FULL, block_size=block_size, page_size_bytes=page)
    layers = []
    for i, kind in enumerate(layer_kinds):
        if kind == "M":
            layers.append((mamba_name.format(i), mamba))
        elif kind == "*":
            layers.append((attention_name.format(i), full))
    return layers


def granite_4_0_h_tiny() -> ModelGroups:
    """Granite 4.0-H-Tiny: 40 layers, 36 Mamba2 and 4 attention (layers 5, 15, 25, 35).

    Config facts (ibm-granite/granite-4.0-h-tiny config.json) as transcribed in public
    test fixtures that quote it (a granitemoehybrid config: hidden_size 1536,
    num_attention_heads 12, num_key_value_heads 4, mamba_n_heads 48, mamba_d_head 64,
    mamba_n_groups 1, mamba_d_state 128, mamba_d_conv 4, mamba_expand 2, layer_types
    5 mamba, attention, then 9 mamba and an attention layer three times, 4 mamba);
    attention head dim 1536 / 12 = 128. Layer names from vLLM's granitemoehybrid.py
    (``model.layers.{i}.mixer``, ``model.layers.{i}.self_attn.attn``).

    Block size: an attention page is 2048 bytes a token; 16 x ceil(806,400 / (16 x
    2048)) = 400 tokens (page 819,200 bytes). vLLM makes 9 Mamba groups of 4 layers
    (every 9th Mamba layer) and 1 attention group of 4.
    """
    kinds = ["M"] * 40
    for i in (5, 15, 25, 35):
        kinds[i] = "*"
    layers = _mamba2_and_attention(
        kinds,
        state_bytes=GRANITE_4_0_H_TINY_STATE_BYTES,
        num_kv_heads=4,
        head_dim=128,
        mamba_name="model.layers.{}.mixer",
        attention_name="model.layers.{}.self_attn.attn",
    )
    return ModelGroups(
        groups=group_layers_like_vllm(layers), model_id="ibm-granite/granite-4.0-h-tiny"
    )


def nemotron_nano_9b_v2() -> ModelGroups:
    """NVIDIA-Nemotron-Nano-9B-v2 (NemotronH): 56 layers, 27 Mamba2, 4 attention, 25 MLP.

    Config facts (nvidia/NVIDIA-Nemotron-Nano-9B-v2 config.json) as transcribed in
    several public repos' fixtures that quote it: hidden_size 4480, num_attention_heads
    40, num_key_value_heads 8, head_dim 128, mamba_num_heads 128, mamba_head_dim 80,
    n_groups 8, ssm_state_size 128, conv_kernel 4, hybrid_override_pattern
    ``NEMOTRON_NANO_9B_V2_PATTERN``. Layer names from vLLM's nemotron_h.py
    (``model.layers.{i}.mixer`` for Mamba2, ``model.layers.{i}.mixer.attn``).

    Block size: an attention page is 4096 bytes a token; 16 x ceil(2,695,168 / (16 x
    4096)) = 672 tokens (page 2,752,512 bytes). vLLM makes 7 Mamba groups (every 7th
    Mamba layer: 4 layers, the last three groups 3) and 1 attention group of 4.
    """
    layers = _mamba2_and_attention(
        list(NEMOTRON_NANO_9B_V2_PATTERN),
        state_bytes=NEMOTRON_NANO_9B_V2_STATE_BYTES,
        num_kv_heads=8,
        head_dim=128,
        mamba_name="model.layers.{}.mixer",
        attention_name="model.layers.{}.mixer.attn",
    )
    return ModelGroups(
        groups=group_layers_like_vllm(layers), model_id="nvidia/NVIDIA-Nemotron-Nano-9B-v2"
    )
