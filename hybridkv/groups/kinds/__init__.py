"""The rules of each attention kind, in one table: ``RULES[kind]``.

Hit search, store and load planning, ``inspect`` and group validation all ask
these objects; nothing else branches on a group's kind.
"""

from hybridkv.groups.kinds.base import Found, GroupKind, KindRules
from hybridkv.groups.kinds.chunked_local import ChunkedLocalRules
from hybridkv.groups.kinds.full import FullRules
from hybridkv.groups.kinds.mamba import MambaRules
from hybridkv.groups.kinds.sliding_window import SlidingWindowRules

RULES: dict[GroupKind, KindRules] = {
    rules.kind: rules
    for rules in (FullRules(), SlidingWindowRules(), ChunkedLocalRules(), MambaRules())
}
assert set(RULES) == set(GroupKind), "every kind needs its rules"


def rules_for(kind: GroupKind) -> KindRules:
    return RULES[kind]


__all__ = ["RULES", "Found", "GroupKind", "KindRules", "rules_for"]
