"""Prompts and engine plans shared by the end-to-end tests.

Pure data builders (no vLLM import): the plans are run by ``tests.e2e.driver``
in a subprocess, the tests assert on its records.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybridkv.tools.models import TinyModel, default_prompt_token_ids

MAX_TOKENS = 16
BASE_LENGTHS = (136, 200, 265, 330, 460)
"""Unrelated prompts; none is a multiple of the block size."""

_CONCURRENT_PREFIXES = (
    # (base prompt index, tokens of it to keep; None = all of it)
    (1, None),
    (3, None),
    (4, None),
    (1, 17),
    (3, 32),
    (4, 50),
    (1, 64),
    (3, 100),
    (4, 128),
    (1, 150),
    (3, 192),
    (4, 250),
    (3, 300),
    (4, 400),
    (0, 0),
    (4, None),
)
"""16 prompts sharing stored prefixes of different lengths (aligned or not,
none, or the whole stored prompt) followed by fresh tokens."""


def base_prompts(vocab_size: int) -> list[list[int]]:
    return [
        default_prompt_token_ids(n, vocab_size=vocab_size, seed=100 + i)
        for i, n in enumerate(BASE_LENGTHS)
    ]


def concurrent_prompts(vocab_size: int) -> list[list[int]]:
    bases = base_prompts(vocab_size)
    prompts = []
    for i, (base_id, keep) in enumerate(_CONCURRENT_PREFIXES):
        prefix = bases[base_id][: len(bases[base_id]) if keep is None else keep]
        suffix = default_prompt_token_ids(8 + (i * 7) % 40, vocab_size=vocab_size, seed=200 + i)
        prompts.append(prefix + suffix)
    return prompts


def generate(label: str, prompts: list[list[int]]) -> dict[str, Any]:
    return {"op": "generate", "label": label, "prompts": prompts, "max_tokens": MAX_TOKENS}


RESET = {"op": "reset"}
SETTLE = {"op": "settle"}
"""Wait until every write of the steps before is in the tiers (stores are asynchronous:
a step right after another may look up blocks the first is still writing)."""


INTEGRITY = {"op": "integrity", "label": "integrity"}

GROUPS = {"op": "groups"}


def engine(
    label: str,
    model: TinyModel,
    steps: list[dict[str, Any]],
    connector: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """An engine plan: first its KV cache facts (``groups``), then the steps; with a
    connector, its integrity is checked after them."""
    steps = [GROUPS, *steps]
    if connector is not None:
        steps = [*steps, INTEGRITY]
    return {
        "label": label,
        "kind": model.kind.value,
        "model_dir": str(model.path.parent),
        "seed": model.seed,
        "connector": connector,
        "steps": steps,
    }


def baseline_engine(model: TinyModel) -> dict[str, Any]:
    """No connector: layout, reference outputs, and which groups matter.

    For each group, the prompts run cold, that group's prefix-cached blocks
    are zeroed, and the prompts run again on a prefix-cache hit: if the
    outputs change, a test that loads that group wrongly must fail.
    """
    prompts = base_prompts(model.vocab_size)
    steps = [
        generate("cold", prompts),
        generate("local_hit", prompts),
        RESET,
        generate("concurrent", concurrent_prompts(model.vocab_size)),
    ]
    for group_id in range(len(model.groups)):
        steps += [
            RESET,
            generate(f"refill_{group_id}", prompts),
            {"op": "zero_group", "label": f"zero_{group_id}", "group_id": group_id},
            generate(f"zeroed_{group_id}", prompts),
        ]
    return engine(f"baseline-{model.kind.value}", model, steps)


def connector_config(cache_dir: Path) -> dict[str, Any]:
    return {"cache_dir": str(cache_dir)}


def first_engine(model: TinyModel, cache_dir: Path) -> dict[str, Any]:
    """Cold run stores, warm run (after wiping vLLM's cache) loads, then 16 at once."""
    prompts = base_prompts(model.vocab_size)
    steps = [
        generate("cold", prompts),
        RESET,
        generate("warm", prompts),
        RESET,
        generate("concurrent", concurrent_prompts(model.vocab_size)),
    ]
    return engine("first", model, steps, connector_config(cache_dir))


def restart_plan(model: TinyModel, cache_dir: Path) -> list[dict[str, Any]]:
    """Engines one after another in a fresh process, on what ``first_engine`` stored.

    ``restart``: the CPU tier is empty, hits come from the disk tier.
    ``again``: a second engine in the same process (a notebook, a test session).
    Then every second stored object file is damaged, and ``corrupted`` (new
    tiers, so an empty CPU tier again) must detect it and recompute.
    """
    prompts = base_prompts(model.vocab_size)
    config = connector_config(cache_dir)
    return [
        engine("restart", model, [generate("restart", prompts)], config),
        engine("again", model, [generate("again", prompts)], config),
        {"op": "corrupt_files", "dir": str(cache_dir), "every": 2},
        engine("corrupted", model, [generate("corrupted", prompts)], config),
    ]
