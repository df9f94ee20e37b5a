"""A random-weight EAGLE draft head for a tiny target model, built locally.

Runs in the calling process (tests); torch, transformers and safetensors are
imported inside. vLLM's EAGLE-1 draft (``EagleLlamaForCausalLM``) is one
Llama decoder layer fed ``fc([token embedding, target hidden state])``; it
shares the target's LM head. Random weights draft poor tokens, which is fine:
the engine verifies every drafted token, so outputs stay the target's greedy
ones, and what matters here is that the engine runs with EAGLE drafting on.
"""

from __future__ import annotations

import json
from pathlib import Path

from hybridkv.tools.models.tiny import TinyModel

_DRAFT_VERSION = 1
_MARKER = "hybridkv-draft.json"


def build_eagle_draft(target: TinyModel, out_dir: Path) -> Path:
    """An EAGLE draft head for ``target`` (same hidden size and vocabulary) in ``out_dir``."""
    target_config = json.loads((target.path / "config.json").read_text())
    hidden = int(target_config["hidden_size"])
    config = {
        "architectures": ["EagleLlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(target_config["vocab_size"]),
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": 1,
        "num_attention_heads": int(target_config["num_attention_heads"]),
        "num_key_value_heads": int(target_config["num_key_value_heads"]),
        "head_dim": int(target_config["head_dim"]),
        "max_position_embeddings": int(target_config["max_position_embeddings"]),
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "torch_dtype": target.dtype,
    }
    path = Path(out_dir) / f"eagle-{target.path.name}"
    marker = {"version": _DRAFT_VERSION, "config": config, "seed": target.seed}
    marker_path = path / _MARKER
    if marker_path.exists() and json.loads(marker_path.read_text()) == marker:
        return path
    path.mkdir(parents=True, exist_ok=True)
    _write_weights(config, target.seed, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config, indent=2))
    marker_path.write_text(json.dumps(marker))
    return path


def _write_weights(config: dict[str, object], seed: int, out: Path) -> None:
    import torch
    import transformers
    from safetensors.torch import save_file

    torch.manual_seed(seed + 1)
    llama = transformers.LlamaConfig(
        **{k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    )
    model = transformers.LlamaForCausalLM(llama)
    dtype = getattr(torch, str(config["torch_dtype"]))
    weights = {}
    for name, tensor in model.state_dict().items():
        if not name.startswith("model.layers.") and name != "model.embed_tokens.weight":
            continue  # the final norm and LM head are the target's
        if name.endswith("layers.0.input_layernorm.weight"):
            continue  # the first draft layer has none: its input is fc's output
        weights[name.removeprefix("model.")] = tensor.to(dtype).contiguous()
    hidden = int(str(config["hidden_size"]))
    weights["fc.weight"] = (torch.randn(hidden, 2 * hidden) * 0.02).to(dtype)
    save_file(weights, str(out))
