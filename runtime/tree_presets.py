"""Named static draft trees (Medusa-style choice paths; see `runtime.tree.Tree`).

Data only. `Tree.preset(name)` builds and validates these; "chain-K" trees are generated, not listed here.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

# Medusa's default tree for Vicuna-7B (FasterDecoding/Medusa, medusa/model/medusa_choices.py), in Medusa's
# original (acceptance-ranked) order; `Tree` re-sorts it canonically. 63 nodes + root, depth profile
# {1: 10, 2: 28, 3: 23, 4: 2}, 42 leaves. EAGLE-1 uses the same tree.
MC_SIM_7B_63: tuple[tuple[int, ...], ...] = (
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4), (2, 0), (0, 5),
    (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8), (0, 0, 2), (3, 0), (0, 9), (8,),
    (9,), (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0), (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0),
    (0, 1, 1), (0, 0, 6), (0, 3, 0), (5, 0), (1, 3), (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0),
    (1, 4), (7, 0), (0, 1, 2), (2, 0, 0), (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1),
    (9, 0), (0, 6, 0), (0, 0, 0, 1), (1, 6), (0, 7, 0),
)

STATIC_PRESETS: Mapping[str, tuple[tuple[int, ...], ...]] = MappingProxyType(
    {
        "mc_sim_7b_63": MC_SIM_7B_63,
    }
)
