"""What every attention kind must say about its groups: the interface of a kind's rules.

Pure functions, any process. A group of one kind needs some of a request's
past blocks to resume it at a given length; the rules answer, for that kind:

* hit search (``hybridkv.hits``): which stored blocks it reads and how long
  a hit they allow, asked in sweeps with ``window`` / ``stride`` /
  ``relevant`` / ``find``;
* store planning: which blocks a step that computed tokens ``[start, end)``
  stores (``stored_blocks``): only those a later aligned hit can read, and
  every block any hit the search reports needs;
* load planning: whether every block of a hit must be allocated by the
  engine (``needs_every_block``);
* configuration: which kind parameter a group needs (``param``, checked with
  the kind's own rules by ``param_problems``) and which hit alignments and
  drafting modes it supports.

Adding a kind is one module implementing ``KindRules`` plus one line in
``hybridkv.groups.kinds.RULES``; the engine adapter maps the engine's spec
classes to the kind.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, NamedTuple

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from hybridkv.groups.model_groups import KVGroup

BoolArray = npt.NDArray[np.bool_]


class GroupKind(enum.Enum):
    """Which tokens a group needs to resume a request at a given length."""

    FULL = "full"
    """Every past token: a hit is a prefix."""
    SLIDING_WINDOW = "sliding_window"
    """Only the last ``sliding_window - 1`` tokens before the resume point."""
    CHUNKED_LOCAL = "chunked_local"
    """Only the tokens since the start of the current attention chunk."""
    MAMBA = "mamba"
    """Only the recurrent state after the last block."""


PARAMS = {
    "sliding_window": GroupKind.SLIDING_WINDOW,
    "attention_chunk_size": GroupKind.CHUNKED_LOCAL,
}
"""Each kind parameter of a group, and the one kind that needs it."""


class Found(NamedTuple):
    """One group's answer for one bound: hit length and the blocks ``[first, end)`` it loads."""

    num_tokens: int
    first_block: int
    end_block: int


class KindRules:
    """The rules of one kind of group. Stateless; one shared instance per kind.

    Hit search asks a rule about a window ``[lo, hi)`` of block indices; the
    answers ``have`` (True: every group of the search key holds the block) are
    bytes, one per block of the window. ``drop`` is EAGLE's dropped last
    block, ``a`` / ``align`` the hit alignment in blocks / tokens.
    """

    kind: ClassVar[GroupKind]
    searched_once: ClassVar[bool] = False
    """Hits are prefixes: found once, later sweeps only trim to the candidate."""
    widens_for_eagle: ClassVar[bool] = True
    """With EAGLE the lookup bound grows by one block before one is dropped."""
    supports_eagle: ClassVar[bool] = True
    needs_every_block: ClassVar[bool] = True
    """A block of the hit the engine left unallocated (the null block) makes the load
    impossible. False: the engine keeps only the blocks it reads (sliding windows,
    local chunks) and the others are skipped."""
    blocks_stay_computed: ClassVar[bool] = True
    """A block wholly before a request's computed tokens keeps their KV while the
    request holds it. False for a recurrent state: a step may advance the state block
    it starts from."""

    # --- hit search --------------------------------------------------------------

    def window(self, group: KVGroup, bound: int) -> tuple[int, int]:
        """Block indices ``[lo, hi)`` that can matter for a hit of at most ``bound`` tokens."""
        return 0, bound // group.block_size

    def stride(self, a: int) -> tuple[int, int]:
        """(offset, step): the only block indices the rule ever reads."""
        return 0, 1

    def relevant(self, group: KVGroup, lo: int, maybe: BoolArray, drop: bool, a: int) -> BoolArray:
        """Which indices of the window (``maybe``: no group said missing) can still matter.

        Default: those before the first missing one, for a kind that needs every block
        of the window up to a hit's end."""
        return prefix_mask(maybe)

    def probe(self, group: KVGroup, lo: int, hi: int, drop: bool, a: int) -> range | None:
        """The blocks that, all held, make the longest hit the window allows: asked first,
        alone, when the rule reads far more than them (None: no such shortcut)."""
        return None

    def find(self, group: KVGroup, lo: int, have: bytes, drop: bool, align: int) -> Found:
        raise NotImplementedError

    # --- stores --------------------------------------------------------------------

    def stored_blocks(
        self, group: KVGroup, start: int, end: int, align: int, drop: bool
    ) -> Sequence[int]:
        """Block indices a step that computed tokens ``[start, end)`` stores, increasing.

        Only blocks some later hit (aligned to ``align`` tokens; ``drop``: EAGLE
        drafting drops the group's last hit block) can read are worth storing.
        Default: every block whose last token was computed in the step.
        """
        return range(start // group.block_size, end // group.block_size)

    # --- configuration -------------------------------------------------------------

    param: ClassVar[str | None] = None
    """The group field this kind needs (its window or chunk, in tokens), if any."""

    def param_problems(self, group: KVGroup) -> list[str]:
        """What is wrong with the group's kind parameters (window, chunk size).

        Asked once their field types hold: each is None or an int > 0.
        """
        problems = []
        for name, owner in PARAMS.items():
            value = getattr(group, name)
            if name == self.param and value is None:
                problems.append(
                    f"{name}=None: required for kind {self.kind.value}, must be an int > 0"
                )
            elif name != self.param and value is not None:
                problems.append(f"{name}={value} is only allowed for kind {owner.value}")
        return problems

    def alignment_problem(self, group: KVGroup, align: int) -> str | None:
        """Why hits aligned to ``align`` tokens cannot work for this group (None: they can)."""
        return None

    coarser_alignment_problem: ClassVar[str | None] = None
    """Why hits may not be aligned coarser than the engine aligns its own (None: they
    may)."""


def prefix_mask(mask: BoolArray) -> BoolArray:
    """``mask`` cut at its first False: only a prefix can matter."""
    out = np.zeros_like(mask)
    stop = int(np.argmin(mask)) if not mask.all() else mask.size
    out[:stop] = True
    return out


def first_missing(have: bytes) -> int:
    pos = have.find(b"\x00")
    return len(have) if pos < 0 else pos
