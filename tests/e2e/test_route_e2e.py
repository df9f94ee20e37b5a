"""A router's lookup, from the card a real vLLM engine wrote, answers what the engine then
loads: an engine stores prompts (CPU and disk) and stops; ``hybridkv.route`` reads its
card and says, per prompt, how many tokens and bytes a restarted engine would load
from disk; the restarted engine (empty CPU tier) loads exactly that. Both families:
sliding window + full, Mamba + full.
"""

from __future__ import annotations

import pytest

from hybridkv.connector.card import read_card
from hybridkv.route.lookup import EngineLookup, HitQuery
from hybridkv.tools.models import TinyModelKind
from tests.e2e.expect import counter, describe, full_hit_tokens, summed
from tests.e2e.harness import Harness
from tests.e2e.scenarios import SETTLE, base_prompts, engine, generate

pytestmark = pytest.mark.slow

KINDS = (TinyModelKind.GEMMA3, TinyModelKind.QWEN3_NEXT)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_the_lookup_of_a_stopped_engine_is_what_its_restart_loads(
    kind: TinyModelKind, harness: Harness
) -> None:
    model = harness.model(kind)
    prompts = base_prompts(model.vocab_size)
    cache_dir = harness.cache_dir(f"route-{kind.value}")
    card_path = cache_dir / "card.json"
    config = {"cache_dir": str(cache_dir), "engine_card": str(card_path)}
    first = harness.run(
        f"route-store-{kind.value}",
        [engine("first", model, [generate("cold", prompts), SETTLE], config)],
    )
    assert first.returncode == 0, first.describe_failure()
    card = read_card(card_path)
    router = EngineLookup("first", card)
    answers = [router.find(HitQuery(token_ids=tokens)) for tokens in prompts]
    router.close()
    restart = harness.run(
        f"route-restart-{kind.value}",
        [engine("restart", model, [generate("restart", prompts)], config)],
    )
    assert restart.returncode == 0, restart.describe_failure()
    step = restart.step("restart", "restart")
    where = describe(step)
    facts = {"alignment_tokens": card.alignment_tokens}
    # Every prompt was stored whole: the hit is the longest one the engine allows.
    assert [a.hit_tokens for a in answers] == [full_hit_tokens(len(p), facts) for p in prompts]
    assert [a.hit_tokens for a in answers] == step["num_cached_tokens"], where
    assert all(a.tiers[0].kind == "cpu" and not a.tiers[0].visible for a in answers)
    stats = step["connector"]
    assert counter(stats, "loads", outcome="ok") == len(prompts), where
    assert summed(stats, "loaded_bytes") == sum(a.load_bytes for a in answers) > 0, where
