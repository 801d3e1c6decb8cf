"""Draft trees: one immutable `Tree` type, built once from Medusa-style choice paths.

A tree is a set of *choice paths* (reference-facts section 1). Path (i0, ..., i_{d-1}) is the node at depth d
whose token is the rank-i_{d-1} candidate among its siblings; its parent is the path minus its last element.
The root (the last emitted token, see the vocabulary in `runtime.protocol`) is implicit and never listed.
Nodes are numbered in canonical order: root = 0, then the paths sorted by (length, lexicographic), so a parent
always precedes its children and siblings are contiguous node indices, in rank order.

Dynamic trees (EAGLE-2, reference-facts section 2) are selected from a scored candidate pool by
`select_dynamic_tree`; `expand_frontier` is the per-level pool-growing step.
"""

from __future__ import annotations

import functools
import json
import math
import numbers
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from plugins.tree_attention.mask import ancestor_mask, pack_mask
from runtime.errors import ConfigError
from runtime.tree_presets import STATIC_PRESETS

Path = tuple[int, ...]

_CHAIN_RE = re.compile(r"chain-(\d+)")


def _path_key(path: Path) -> tuple[int, Path]:
    return (len(path), path)


def _is_seq(x: object) -> bool:
    return isinstance(x, (list, tuple)) or (isinstance(x, Sequence) and not isinstance(x, (str, bytes)))


def _is_rank(r: object) -> bool:
    """An int (numpy integers included), not a bool: a path like [True] is almost surely a bug upstream."""
    return type(r) is int or (isinstance(r, numbers.Integral) and not isinstance(r, bool))


def _normalize_choices(
    paths: object, *, max_depth: int | None = None, max_nodes: int | None = None
) -> tuple[Path, ...]:
    """Validate choice paths and return them as canonical tuples; raises ConfigError naming the bad path."""
    if not _is_seq(paths):
        raise ConfigError(f"tree choices must be a list of paths (lists of ints), got {type(paths).__name__}")
    if len(paths) == 0:
        raise ConfigError("tree choices must be a non-empty list of paths; use Tree.root_only() for no draft nodes")
    out: list[Path] = []
    for n, raw in enumerate(paths):
        if not _is_seq(raw):
            raise ConfigError(f"tree choice #{n} must be a list of ints, got {raw!r}")
        if len(raw) == 0:
            raise ConfigError(f"tree choice #{n} is an empty path; the root is implicit and must not be listed")
        for r in raw:
            if not _is_rank(r):
                raise ConfigError(f"tree choice #{n} {list(raw)!r}: ranks must be ints, got {r!r}")
            if r < 0:
                raise ConfigError(f"tree choice #{n} {list(raw)!r}: ranks must be >= 0, got {r}")
        out.append(tuple(int(r) for r in raw))
    seen: set[Path] = set()
    for p in out:
        if p in seen:
            raise ConfigError(f"tree choice {list(p)} is listed more than once")
        seen.add(p)
    for p in out:
        if len(p) > 1 and p[:-1] not in seen:
            raise ConfigError(f"tree choice {list(p)} has no parent: its prefix {list(p[:-1])} is not listed")
    if max_depth is not None:
        for p in out:
            if len(p) > max_depth:
                raise ConfigError(f"tree choice {list(p)} has depth {len(p)}, more than max_depth={max_depth}")
    if max_nodes is not None and len(out) + 1 > max_nodes:
        raise ConfigError(f"tree has {len(out) + 1} nodes (root included), more than max_nodes={max_nodes}")
    return tuple(sorted(out, key=_path_key))


@dataclass(frozen=True)
class Tree:
    """An immutable draft-tree topology. Build it with `from_choices`, `chain`, `preset`, `parse` or `root_only`.

    Equality and hashing are by `choices`. Tensor properties return fresh copies (callers may move or modify
    them); the Python-level accessors (`children`, `parent_list`, ...) return tuples.
    """

    choices: tuple[Path, ...]  # canonical order; node j + 1 is choices[j]
    _parents: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _children: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    _index: dict[Path, int] = field(init=False, repr=False, compare=False)
    _leaves: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _mask: torch.Tensor = field(init=False, repr=False, compare=False)  # [num_nodes, num_nodes] bool
    # Packed on first use and kept: a static tree is verified every decode step.
    _packed: torch.Tensor | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        if not isinstance(self.choices, tuple):
            raise ConfigError("Tree(choices=...) takes a tuple of int tuples; use Tree.from_choices(paths)")
        # Cheap re-check of what from_choices guarantees, so a directly constructed Tree is valid too.
        index: dict[Path, int] = {(): 0}
        prev: tuple[int, Path] = (0, ())
        for j, p in enumerate(self.choices):
            if not isinstance(p, tuple) or not p or not all(type(r) is int and r >= 0 for r in p):
                raise ConfigError(
                    f"Tree(choices=...) entry {p!r} is not a non-empty tuple of ints >= 0; use Tree.from_choices"
                )
            if _path_key(p) <= prev or p[:-1] not in index:
                raise ConfigError(
                    f"Tree(choices=...) must be canonical (sorted by length then lexicographically, unique, "
                    f"prefix-closed); {list(p)} breaks that: use Tree.from_choices"
                )
            prev = _path_key(p)
            index[p] = j + 1
        parents = (-1,) + tuple(index[p[:-1]] for p in self.choices)
        children: list[list[int]] = [[] for _ in parents]
        for i in range(1, len(parents)):
            children[parents[i]].append(i)  # canonical order == rank order among siblings
        n = len(parents)
        mask = ancestor_mask(parents)  # [n, n]; canonical order puts every parent before its children
        # Leaves in Medusa's retrieve order: reverse canonical order, i.e. longest first and, among equal
        # depths, reverse lexicographic (this is what reproduces Medusa's retrieve_indices golden vector).
        leaves = tuple(i for i in reversed(range(n)) if not children[i])
        object.__setattr__(self, "_parents", parents)
        object.__setattr__(self, "_children", tuple(tuple(c) for c in children))
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_leaves", leaves)
        object.__setattr__(self, "_mask", mask)

    # ---- construction -------------------------------------------------------------------------------------

    @classmethod
    def from_choices(
        cls, paths: Sequence[Sequence[int]], max_depth: int | None = None, max_nodes: int | None = None
    ) -> Tree:
        """Validate Medusa-style choice paths (any order) and build the tree.

        max_depth bounds the path length; max_nodes bounds the node count, root included.
        """
        return _built(_normalize_choices(paths, max_depth=max_depth, max_nodes=max_nodes))

    @classmethod
    def root_only(cls) -> Tree:
        """The tree with no draft nodes (vanilla decoding: one token per target forward)."""
        return cls(())

    @classmethod
    def chain(cls, k: int) -> Tree:
        """A single path of k draft nodes (each the top-1 candidate): classic speculative decoding."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ConfigError(f"chain length must be an int >= 0, got {k!r}")
        return cls(tuple((0,) * d for d in range(1, k + 1)))

    @classmethod
    def preset(cls, name: str) -> Tree:
        """A named tree: 'mc_sim_7b_63' (Medusa's default) or 'chain-K' (K >= 0)."""
        if name in STATIC_PRESETS:
            return cls.from_choices(STATIC_PRESETS[name])
        m = _CHAIN_RE.fullmatch(name) if isinstance(name, str) else None
        if m is not None:
            return cls.chain(int(m.group(1)))
        raise ConfigError(f"unknown tree preset {name!r}; expected one of {', '.join(cls.presets())}")

    @staticmethod
    def presets() -> tuple[str, ...]:
        """Preset names accepted by `preset` ('chain-K' stands for chain-1, chain-2, ...)."""
        return tuple(sorted(STATIC_PRESETS)) + ("chain-K",)

    @classmethod
    def from_json(cls, text: str) -> Tree:
        """Inverse of `to_json`: a JSON list of paths, e.g. '[[0],[1],[0,0]]'. '[]' is the root-only tree."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"tree JSON {text[:80]!r} does not parse: {e}") from e
        if data == []:
            return cls.root_only()
        return cls.from_choices(data)

    @classmethod
    def parse(cls, spec: str | Tree) -> Tree:
        """The CLI boundary: a preset name ('mc_sim_7b_63', 'chain-4') or a JSON list of paths."""
        if isinstance(spec, Tree):
            return spec
        if not isinstance(spec, str):
            raise ConfigError(f"tree spec must be a preset name or a JSON list of paths, got {type(spec).__name__}")
        text = spec.strip()
        if text.startswith("["):
            return cls.from_json(text)
        return cls.preset(text)

    def to_json(self) -> str:
        return json.dumps([list(p) for p in self.choices], separators=(",", ":"))

    # ---- topology -----------------------------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        """Root included."""
        return len(self._parents)

    @property
    def max_depth(self) -> int:
        return len(self.choices[-1]) if self.choices else 0

    @property
    def parents(self) -> torch.Tensor:
        """[num_nodes] int64, root -1."""
        return torch.tensor(self._parents, dtype=torch.int64)

    @property
    def parent_list(self) -> tuple[int, ...]:
        return self._parents

    @property
    def depth(self) -> torch.Tensor:
        """[num_nodes] int64, root 0: the position offset of each node from the root's position."""
        return torch.tensor([0] + [len(p) for p in self.choices], dtype=torch.int64)

    @property
    def ranks(self) -> torch.Tensor:
        """[num_nodes] int64: sibling rank (last element of the path), root 0."""
        return torch.tensor([0] + [p[-1] for p in self.choices], dtype=torch.int64)

    def children(self, i: int) -> tuple[int, ...]:
        """Node indices of i's children, in rank order."""
        return self._children[i]

    def index(self, path: Sequence[int]) -> int:
        """Node index of a choice path (() is the root)."""
        key = tuple(path)
        if key not in self._index:
            raise ConfigError(f"path {list(key)} is not a node of this tree")
        return self._index[key]

    def path(self, i: int) -> tuple[int, ...]:
        """Node indices from the root to i, root first."""
        out = []
        while i >= 0:
            out.append(i)
            i = self._parents[i]
        return tuple(reversed(out))

    @property
    def leaves(self) -> tuple[int, ...]:
        """Leaf node indices in `retrieve_paths` row order."""
        return self._leaves

    def is_leaf(self, i: int) -> bool:
        return not self._children[i]

    def best_nodes(self, max_nodes: int, max_depth: int | None = None,
                   scores: Sequence[float] | None = None) -> tuple[int, ...]:
        """The node indices (ascending: canonical order, root first) of the ancestor-closed subtree of at most
        max_nodes nodes, none deeper than max_depth, that pruning keeps.

        Priority: fewest sibling ranks summed along the path, then shallowest, then canonical order. Drafters rank
        a node's children best first, so a node's rank sum counts the times its path leaves its drafter's best guess:
        the top-1 chain goes first (a depth-2 top-1 node is usually likelier than a depth-1 rank-2 one), and the
        siblings kept are the first ones in rank order (what the verification of sampled proposals needs). A node's
        parent sorts before it (no larger sum, smaller depth), so every prefix of the priority order is
        ancestor-closed, and a smaller budget keeps a subset of what a larger one keeps.

        scores # [num_nodes] (a drafter's path log-probs, `Draft.scores`): the highest score goes first instead,
        ties by the rule above. A node never counts above an ancestor (its score is capped at its parent's), so
        prefixes stay ancestor-closed.
        """
        if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1:
            raise ConfigError(f"max_nodes must be an int >= 1 (the root counts), got {max_nodes!r}")
        if max_nodes >= self.num_nodes and (max_depth is None or max_depth >= self.max_depth):
            return tuple(range(self.num_nodes))  # every decode step's common case: nothing to prune
        depth_ok = [max_depth is None or len(p) <= max_depth for p in self.choices]
        rank_sum = [0] * self.num_nodes
        capped = [0.0] * self.num_nodes if scores is None else capped_scores(self._parents, scores)
        for j, p in enumerate(self.choices):  # parents come first in canonical order
            rank_sum[j + 1] = rank_sum[self._parents[j + 1]] + p[-1]
        order = sorted((i for i in range(1, self.num_nodes) if depth_ok[i - 1]),
                       key=lambda i: (-capped[i], rank_sum[i], len(self.choices[i - 1]), i))
        return (0,) + tuple(sorted(order[: max_nodes - 1]))

    def subtree(self, nodes: Sequence[int]) -> Tree:
        """The tree of these nodes (ancestor-closed, root included, e.g. `best_nodes`'); its node k is the k-th of
        them in ascending order, with its path (ranks) unchanged."""
        return Tree.from_choices([self.choices[i - 1] for i in sorted(nodes) if i]) if len(nodes) > 1 \
            else Tree.root_only()

    def max_rank_per_depth(self) -> tuple[int, ...]:
        """Entry d-1 = how many top-k candidates depth d needs (1 + the largest rank used there)."""
        out = [0] * self.max_depth
        for p in self.choices:
            out[len(p) - 1] = max(out[len(p) - 1], p[-1] + 1)
        return tuple(out)

    # ---- buffers ------------------------------------------------------------------------------------------

    @property
    def mask(self) -> torch.Tensor:
        """[num_nodes, num_nodes] bool: mask[i, j] <=> j is an ancestor of i or i itself."""
        return self._mask.clone()

    @property
    def packed_mask(self) -> torch.Tensor:
        """[num_nodes, ceil(num_nodes / 32)] int32, TensorRT-LLM attention-plugin bit layout."""
        if self._packed is None:
            object.__setattr__(self, "_packed", pack_mask(self._mask))
        return self._packed.clone()

    @property
    def retrieve_paths(self) -> torch.Tensor:
        """[num_leaves, max_depth + 1] int64: root-to-leaf node indices, -1 padded, longest first.

        Rows follow `leaves` (ties between equal depths in reverse canonical order, as Medusa lays them out).
        """
        width = self.max_depth + 1
        rows = [list(self.path(leaf)) for leaf in self._leaves]
        return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int64)

    def medusa_tree_indices(self, topk: int) -> torch.Tensor:
        """[num_nodes] int64: each node's index in Medusa's flat candidate layout [root, head0 top-k, head1 top-k, ...].

        A node at depth d with rank r is candidate 1 + topk * (d - 1) + r; the root is 0.
        """
        need = max(self.max_rank_per_depth(), default=0)
        if isinstance(topk, bool) or not isinstance(topk, int) or topk < max(need, 1):
            raise ConfigError(f"topk must be an int >= {max(need, 1)} (the largest rank used + 1), got {topk!r}")
        return torch.tensor([0] + [1 + topk * (len(p) - 1) + p[-1] for p in self.choices], dtype=torch.int64)

    def __repr__(self) -> str:
        return f"Tree(num_nodes={self.num_nodes}, max_depth={self.max_depth}, leaves={len(self._leaves)})"


@functools.lru_cache(maxsize=4096)
def _built(choices: tuple[Path, ...]) -> Tree:
    """The tree of canonical choices, built once per process: a Tree is immutable, and decoding asks for the same
    few shapes step after step (a static tree's pruned subtrees, its merges with lookup continuations)."""
    return Tree(choices)


# ---- dynamic trees (EAGLE-2) ------------------------------------------------------------------------------


@dataclass(frozen=True)
class CandidatePool:
    """Scored candidates not yet cut to a node budget (EAGLE-2's pool, its pruned entries left out). A session that
    has one offers it as `candidates(root, params, generator, max_nodes)` (None when it drafts a fixed tree), so a
    merge (`runtime.drafters.merged`) can fill its budget from the best candidates of every source rather than from
    each source's own best few."""

    parents: torch.Tensor  # [P] int64: an earlier entry's index, -1 for the root's children
    tokens: torch.Tensor  # [P] int64
    scores: torch.Tensor  # [P] float32: the log-probability the drafter gives each entry's whole path


def _check_pool(parents: torch.Tensor, scores: torch.Tensor, tokens: torch.Tensor | None = None) -> None:
    if parents.ndim != 1 or parents.dtype not in (torch.int32, torch.int64):
        raise ConfigError(f"pool parents must be a 1-D int tensor, got {parents.dtype} {tuple(parents.shape)}")
    if scores.ndim != 1 or not scores.dtype.is_floating_point or scores.shape != parents.shape:
        raise ConfigError(
            f"pool scores must be a 1-D float tensor shaped like parents {tuple(parents.shape)}, "
            f"got {scores.dtype} {tuple(scores.shape)}"
        )
    if tokens is not None and (tokens.ndim != 1 or tokens.shape != parents.shape):
        raise ConfigError(f"pool tokens must be shaped like parents {tuple(parents.shape)}, got {tuple(tokens.shape)}")
    idx = torch.arange(parents.shape[0], device=parents.device)
    bad = ((parents < -1) | (parents >= idx)).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise ConfigError(
            f"pool parents[{i}] = {int(parents[i])}: expected -1 (child of the root) "
            f"or an earlier pool index in [0, {i})"
        )


def select_dynamic_pool(parents: torch.Tensor, scores: torch.Tensor, total_tokens: int,
                        min_score: float | None = None) -> tuple[Tree, torch.Tensor]:
    """EAGLE-2 rerank: keep the best (total_tokens - 1) pool entries plus the root, as an ancestor-closed tree;
    with min_score, only entries whose effective score (below) is at least min_score (pruning: fewer nodes).

    parents  # [P] int: pool index of each entry's parent, -1 for children of the root; parents[i] < i
    scores   # [P] float: cumulative draft log-probability of each entry's path
    Returns (tree, pool_index # [num_nodes] int64: the pool entry of each tree node, -1 for the root).

    Ancestor closure: accepting a node requires accepting every ancestor, so a node is never worth more than its
    path. Each entry is ranked by its *effective* score, the minimum score along its path (NaN counts as -inf),
    with ties going to the earlier-created entry. A parent then always ranks before its children (effective score
    >= theirs, smaller index), so the top (total_tokens - 1) is ancestor-closed and exactly total_tokens - 1 long
    (or the whole pool if smaller): nodes are neither dropped nor added beyond the budget. With well-formed
    scores (a child's cumulative log-prob <= its parent's) this is the plain top-k of EAGLE-2.
    Sibling ranks follow (effective score, raw score) descending, then creation order.
    """
    _check_pool(parents, scores)
    tree, entries = _select_entries(parents.tolist(), scores.double().tolist(), total_tokens, min_score)
    return tree, torch.tensor([-1] + entries, dtype=torch.int64)


def _select_entries(par: list[int], scores: list[float], total_tokens: int,
                    min_score: float | None) -> tuple[Tree, list[int]]:
    """`select_dynamic_pool` over a well-formed pool as lists: the tree and the pool entry of each node below its
    root, in node order."""
    if isinstance(total_tokens, bool) or not isinstance(total_tokens, int) or total_tokens < 1:
        raise ConfigError(f"total_tokens must be an int >= 1 (root included), got {total_tokens!r}")
    raw = [-math.inf if math.isnan(s) else s for s in scores]
    eff = list(raw)
    for i, p in enumerate(par):
        if p >= 0:
            eff[i] = min(eff[i], eff[p])  # parents precede children, so eff[p] is final here
    order = sorted(range(len(par)), key=lambda i: (-eff[i], i))
    if min_score is not None:
        order = [i for i in order if eff[i] >= min_score]  # a prefix of the order: still ancestor-closed
    keep = sorted(order[: max(0, min(total_tokens - 1, len(order)))])
    siblings: dict[int, list[int]] = {}
    for i in keep:
        siblings.setdefault(par[i], []).append(i)
    rank: dict[int, int] = {}
    for group in siblings.values():
        for r, i in enumerate(sorted(group, key=lambda i: (-eff[i], -raw[i], i))):
            rank[i] = r
    paths: dict[int, Path] = {}
    for i in keep:  # creation order: a parent's path exists before its children's
        paths[i] = (paths[par[i]] if par[i] >= 0 else ()) + (rank[i],)
    if not paths:
        return Tree.root_only(), []
    tree = Tree.from_choices(list(paths.values()))
    entry = {p: i for i, p in paths.items()}
    return tree, [entry[p] for p in tree.choices]


def capped_scores(parents: Sequence[int], scores: Sequence[float]) -> list[float]:
    """Path scores as the rankings use them: each node's capped at its parent's, NaN as -inf, the root's 0, so a
    node never ranks above an ancestor. parents # [num_nodes] (canonical order: a parent before its children);
    scores # [num_nodes]."""
    out = [0.0]
    for node in range(1, len(parents)):
        s = float(scores[node])
        out.append(min(-math.inf if math.isnan(s) else s, out[parents[node]]))
    return out


def cost_budget(
    parents: Sequence[int],  # [num_nodes] canonical order (a parent before its children), the root's -1
    scores: Sequence[float],  # [num_nodes] path log-probabilities (Draft.scores), the root's 0
    cost: Sequence[float],  # [max nodes] cost[n - 1]: a target forward over n nodes, relative to one node's
) -> int:
    """The node count n (root included) whose best nodes (`Tree.best_nodes`' order by score) give the most expected
    tokens per unit of verify cost: argmax over n of (1 + the sum of the n - 1 best non-root nodes' path
    probabilities) / cost[n - 1]. A node's path probability is what the drafter expects of it being on the accepted
    path, so the sum is the expected accepted length and the 1 the bonus token; n stops at the tree's size and the
    curve's length. Ties go to fewer nodes."""
    probs = sorted((math.exp(s) for s in capped_scores(parents, scores)[1:]), reverse=True)
    best, best_value, expected = 1, 1.0 / cost[0], 1.0
    for n in range(2, min(len(parents), len(cost)) + 1):
        expected += probs[n - 2]
        value = expected / cost[n - 1]
        if value > best_value:
            best, best_value = n, value
    return best


def deeper_pays(
    tree: Tree,
    scores: Sequence[float],  # [num_nodes] path log-probabilities, known to depth `known` (the rest anything)
    known: int,
    cost: Sequence[float],  # as `cost_budget`'s
) -> bool:
    """Whether a node deeper than `known` could be among those the verify-cost cut keeps (`cost_budget`, then
    `Tree.best_nodes`), each such node counted at its deepest known ancestor's score (no child is likelier than its
    parent). False: drafting them cannot change what the cut keeps, so a drafter may stop. Why: with every unknown node
    at that bound the cut keeps known nodes only; at their real scores the unknown nodes rank no earlier and each
    count's expected tokens are no more, so the best count is no larger and its nodes the same known ones."""
    depth = tree.depth.tolist()
    parents = tree.parent_list
    bound = [0.0] * tree.num_nodes
    for i in range(1, tree.num_nodes):  # parents first: an unknown node takes its parent's (bounded) score
        bound[i] = float(scores[i]) if depth[i] <= known else bound[parents[i]]
    n = cost_budget(parents, bound, cost)
    return any(depth[i] > known for i in tree.best_nodes(n, scores=bound))


def pool_above(parents: torch.Tensor, scores: torch.Tensor, min_score: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries of a candidate pool that pruning keeps: those whose path scores, the entry's and its ancestors',
    all reach min_score (NaN never does), so what is kept is ancestor-closed.

    parents  # [P] int: -1 for children of the root, else an earlier pool index
    scores   # [P] float: cumulative draft log-probability
    Returns (index # [K] int64: the kept entries, in pool order; parents # [K] int64: theirs among the kept, -1 for
    the root's children).
    """
    _check_pool(parents, scores)
    par = parents.tolist()
    keep: list[bool] = []
    new_index: list[int] = []  # pool index -> its index among the kept (meaningful for kept entries)
    kept: list[int] = []
    for i, s in enumerate(scores.tolist()):
        keep.append(s >= min_score and (par[i] < 0 or keep[par[i]]))
        new_index.append(len(kept))
        if keep[i]:
            kept.append(i)
    kept_parents = [new_index[par[i]] if par[i] >= 0 else -1 for i in kept]
    return torch.tensor(kept, dtype=torch.int64), torch.tensor(kept_parents, dtype=torch.int64)


def pruned_pool(pool: CandidatePool, min_score: float) -> CandidatePool:
    """The entries of a candidate pool that pruning keeps (`pool_above`), renumbered, on the pool's device."""
    index, parents = pool_above(pool.parents, pool.scores, min_score)
    index = index.to(pool.tokens.device)
    return CandidatePool(parents.to(index.device), pool.tokens[index], pool.scores[index])


def select_dynamic_tree(
    parents: torch.Tensor, tokens: torch.Tensor, scores: torch.Tensor, total_tokens: int, root_token: int = -1,
    min_score: float | None = None,
) -> tuple[Tree, torch.Tensor, torch.Tensor]:
    """EAGLE-2 dynamic tree from a candidate pool (see `select_dynamic_pool` for the selection rule).

    parents  # [P] int: -1 for children of the root, else an earlier pool index
    tokens   # [P] int64: each entry's token
    scores   # [P] float: cumulative draft log-probability
    Returns (tree, node_tokens # [num_nodes] int64, node_scores # [num_nodes] float32, on the CPU) with
    node_tokens[0] = root_token (pass the root so the result can go straight into a `Draft`) and node_scores the
    effective scores the selection ranked by (the root's 0).
    """
    _check_pool(parents, scores, tokens)
    return select_dynamic_tree_lists(parents.tolist(), tokens.tolist(), scores.double().tolist(), total_tokens,
                                     root_token, min_score)


def select_dynamic_tree_lists(
    parents: list[int], tokens: list[int], scores: list[float], total_tokens: int, root_token: int = -1,
    min_score: float | None = None,
) -> tuple[Tree, torch.Tensor, torch.Tensor]:
    """`select_dynamic_tree` of a pool held in Python lists, which it trusts to be well formed (parents[i] in
    [-1, i)): for callers that build their pool in Python (`runtime.drafters.merged.merge_pools`) and would
    otherwise pay for tensors made only to be read back."""
    tree, entries = _select_entries(parents, scores, total_tokens, min_score)
    node_tokens = torch.tensor([root_token] + [tokens[e] for e in entries], dtype=torch.int64)
    effective = capped_scores(tree.parent_list, [0.0] + [scores[e] for e in entries])
    return tree, node_tokens, torch.tensor(effective, dtype=torch.float32)


class Expansion(NamedTuple):
    """One EAGLE-2 expansion level (see `expand_frontier`)."""

    parent: torch.Tensor  # [k * t] int64: frontier row each candidate extends
    tokens: torch.Tensor  # [k * t] int64
    scores: torch.Tensor  # [k * t] float: cumulative log-prob (parent score + candidate log-prob)
    frontier: torch.Tensor  # [min(top_k, k * t)] int64: indices into the candidates, best first


def expand_frontier(frontier_scores: torch.Tensor, logprobs: torch.Tensor, top_k: int) -> Expansion:
    """Expand each frontier node by its top_k next tokens and pick the next frontier by cumulative log-prob.

    frontier_scores  # [k] float: cumulative log-prob of each frontier node
    logprobs         # [k, V] float: the draft's next-token log-probs at each frontier node
    All k * t candidates (t = min(top_k, V)) join the pool, in this order (so pool parent of candidate c is the
    pool index of frontier row parent[c]); `frontier` names the top_k of them to expand at the next level.
    NaN log-probs / scores rank as -inf.
    """
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ConfigError(f"top_k must be an int >= 1, got {top_k!r}")
    if logprobs.ndim != 2 or frontier_scores.shape != (logprobs.shape[0],):
        raise ConfigError(
            f"expected frontier_scores [k] and logprobs [k, V], got {tuple(frontier_scores.shape)} and "
            f"{tuple(logprobs.shape)}"
        )
    k, vocab = logprobs.shape
    t = min(top_k, vocab)
    lp = torch.nan_to_num(logprobs, nan=-math.inf)
    top_lp, top_tok = lp.topk(t, dim=-1)  # [k, t]
    cum = torch.nan_to_num(frontier_scores, nan=-math.inf).unsqueeze(-1) + top_lp  # [k, t]
    cum = torch.nan_to_num(cum.reshape(-1), nan=-math.inf)  # (+inf) + (-inf) = NaN must not win topk
    frontier = cum.topk(min(top_k, cum.shape[0])).indices
    parent = torch.arange(k, device=logprobs.device).repeat_interleave(t)
    return Expansion(parent=parent, tokens=top_tok.reshape(-1).to(torch.int64), scores=cum, frontier=frontier)


__all__ = ["Tree", "Expansion", "cost_budget", "deeper_pays", "expand_frontier", "select_dynamic_pool",
           "select_dynamic_tree", "select_dynamic_tree_lists"]
