"""Engine plans on the real models' shapes (``hybridkv.tools.models.shapes``).

Pure data builders (no vLLM import), run by ``tests.e2e.driver`` in a
subprocess: one engine per shape records its KV cache groups, prefills one
prompt of about the length a benchmark uses, then runs it again from vLLM's
own prefix cache. Short on purpose: the shapes are 100-700 M parameters and
prefill takes seconds on 2 cores.
"""

from __future__ import annotations

from typing import Any

from hybridkv.tools.models import ShapeModel, default_prompt_token_ids
from tests.e2e.scenarios import GROUPS

PROMPT_TOKENS = 600
MAX_TOKENS = 4


def shape_prompt(model: ShapeModel) -> list[int]:
    return default_prompt_token_ids(PROMPT_TOKENS, vocab_size=model.vocab_size, seed=600)


def _generate(label: str, prompt: list[int]) -> dict[str, Any]:
    return {"op": "generate", "label": label, "prompts": [prompt], "max_tokens": MAX_TOKENS}


def shape_engine(model: ShapeModel) -> dict[str, Any]:
    """Groups, a cold prefill (``cold``), the same prompt again (``hit``); no connector."""
    prompt = shape_prompt(model)
    return {
        "label": model.kind.value,
        "shape": model.kind.value,
        "model_dir": str(model.path.parent),
        "seed": model.seed,
        "connector": None,
        "steps": [GROUPS, _generate("cold", prompt), _generate("hit", prompt)],
    }
