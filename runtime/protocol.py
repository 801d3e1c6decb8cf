"""What passes between draft -> verify -> commit, and the drafter protocol.

Vocabulary (used across runtime/):
    committed sequence  x_0 .. x_{L-1}: tokens whose KV entries are in the target's cache.
    hidden state h_i    the target's final-norm output at position i (the input of lm_head that predicts x_{i+1}).
    root                the last emitted token x_L. Its KV is not cached yet: every tree step feeds it again
                        as node 0 of the tree, at position L.
    draft tree          root + candidate tokens (nodes 1..N-1) arranged as a `Tree`; node i sits at position
                        L + depth[i].
    accepted tokens     draft nodes the verifier keeps, along one root-to-node path.
    bonus token         drawn from the target (argmax when greedy) at an accepted node that has no children: it
                        becomes the next root.
    residual token      drawn from the residual distribution at the deepest accepted node once all its children
                        were rejected (greedy: the target argmax there); it also becomes the next root.
                        Exactly one bonus or residual token ends every step.
    tau                 tokens emitted per target forward (accepted + 1).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from runtime.draft_spec import DraftSpec
    from runtime.sampling import SamplingParams
    from runtime.tree import Tree


class Proposal(enum.Enum):
    """How a drafter chose the children of each node; the verifier's acceptance rule must match it."""

    DETERMINISTIC = "deterministic"  # top-k / fixed candidates: q_c = one-hot(x)   (reference-facts 3c)
    IID = "iid"  # children drawn i.i.d. from q                                      (3a, SpecInfer)
    WITHOUT_REPLACEMENT = "without_replacement"  # drawn from q without replacement (3b, Sequoia)


@dataclass(frozen=True)
class Draft:
    """One drafted tree, ready for a target forward."""

    tree: Tree
    tokens: torch.Tensor  # [num_nodes] int64; tokens[0] is the root
    proposal: Proposal = Proposal.DETERMINISTIC
    # q at each node over its children's vocabulary; required for IID / WITHOUT_REPLACEMENT, None otherwise.
    draft_probs: torch.Tensor | None = None  # [num_nodes, vocab] float32
    # Each node's path score, when the drafter ranks its nodes: the log-probability it gives the node's whole path
    # (EAGLE-2's score; root 0, a child never above its parent). Used to merge drafts under a node budget
    # (`runtime.drafters.merged`); verification never reads it.
    scores: torch.Tensor | None = None  # [num_nodes] float32

    def __post_init__(self) -> None:
        if self.tokens.ndim != 1 or self.tokens.shape[0] != self.tree.num_nodes:
            raise ValueError(
                f"draft tokens shape {tuple(self.tokens.shape)} does not match tree with {self.tree.num_nodes} nodes"
            )
        if self.scores is not None and self.scores.shape != self.tokens.shape:
            raise ValueError(
                f"draft scores shape {tuple(self.scores.shape)} does not match tree with {self.tree.num_nodes} nodes"
            )
        if self.proposal is not Proposal.DETERMINISTIC and self.draft_probs is None:
            raise ValueError(f"proposal {self.proposal.value} needs draft_probs")


@dataclass(frozen=True)
class Verdict:
    """What the verifier kept from one draft."""

    path: torch.Tensor  # [a + 1] int64 node indices root-first (path[0] == 0); a = number of accepted tokens
    tokens: torch.Tensor  # [a + 1] int64: the a accepted draft tokens, then the bonus/residual token
    bonus: bool  # True: last token is a bonus token (leaf accepted); False: a residual/corrected token

    @property
    def num_accepted(self) -> int:
        return int(self.path.shape[0]) - 1


class DraftSession(Protocol):
    """Per-request drafter state. Created by `Drafter.start`, driven by the decode loop."""

    def draft(self, root: int, params: SamplingParams, generator: torch.Generator | None,
              max_nodes: int | None = None) -> Draft:
        """Propose a tree rooted at `root` (the last emitted token). max_nodes (root included): the most nodes the
        caller will verify this step (the scheduler's share of its tree budget); the caller prunes the tree to it
        (`Tree.best_nodes`) whatever comes back, so a session may use it only to draft less."""
        ...

    def advance(self, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        """Tokens just committed to the target cache and their hidden states. A step may have had no draft (a
        plain step: the scheduler's tree budget left the request its root alone): advance follows all the same.

        tokens  # [a] int64: x_L .. x_{L+a-1} (the previous root followed by the accepted draft tokens)
        hidden  # [a, H]:    h_L .. h_{L+a-1} ([a, H * (1 + F)] for a drafter with F `feature_layers`: each row
                #            the final-norm state, then those target layers' features, `runtime.model`)
        """
        ...


class Drafter(Protocol):
    """Shared, read-only drafting weights; `start` makes the per-request session."""

    name: str  # its kind (runtime.draft_spec.kind_names())
    spec: DraftSpec  # what it drafts, every default resolved (load_drafter's drafters; the weights path is not kept)
    # Optional: target layers whose features (`runtime.model`: the residual stream entering each) the drafter reads
    # beside the final-norm state, strictly increasing (EAGLE-3's low / middle / high layers); absent or (): none.
    # `feature_layers_of` reads it.
    feature_layers: tuple[int, ...]

    def start(self, prompt: torch.Tensor, hidden: torch.Tensor, max_nodes: int) -> DraftSession:
        """prompt # [P] int64 (x_0 .. x_{P-1}, all committed); hidden # [P, H] (h_0 .. h_{P-1}; wider with
        feature_layers, as in `DraftSession.advance`).

        max_nodes bounds the tree size (root included) the session may return.
        """
        ...



def feature_layers_of(drafter: Drafter) -> tuple[int, ...]:
    """The target layers whose features `drafter` reads (`Drafter.feature_layers`; () for most drafters)."""
    return tuple(getattr(drafter, "feature_layers", ()))
