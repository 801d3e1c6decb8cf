"""Lossless verification of a draft tree against the target's logits (reference-facts section 3).

Vocabulary (accepted / bonus / residual tokens, tau): see the module docstring of `runtime.protocol`.

Greedy (temperature 0): the emitted tokens equal greedy autoregressive decoding token for token.
Sampling: tree rejection sampling whose output is distributed exactly as autoregressive sampling from
p = `target_probs(logits, params)` at every position. At the current node the children are tried in rank
order; child x (draft proposal q_c) is accepted with probability min(1, p(x) / q_c(x)) using a fresh uniform;
on rejection p becomes the residual and the next child is tried; once every child is rejected the residual
token is drawn from the final residual; an accepted leaf ends the step with a bonus token drawn from p there.
The residual update depends on how the drafter produced the children (`Draft.proposal`):
  DETERMINISTIC        q_c = one-hot(x): accept with probability p(x); residual p(x) <- 0, renormalised.
  IID                  children i.i.d. from q: residual p <- norm(max(0, p - q)); q unchanged.
  WITHOUT_REPLACEMENT  residual p <- norm(max(0, p - q_i)); q_{i+1} <- norm(q_i with x_i removed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from runtime.errors import ConfigError
from runtime.protocol import Draft, Proposal, Verdict
from runtime.sampling import SamplingParams, greedy_tokens, sample, target_probs


def _check_inputs(draft: Draft, target_logits: torch.Tensor) -> list[int]:
    """Shape checks; returns the draft tokens as a list."""
    n = draft.tree.num_nodes
    if target_logits.ndim != 2 or target_logits.shape[0] != n:
        raise ConfigError(f"target_logits must be [num_nodes={n}, vocab], got {tuple(target_logits.shape)}")
    vocab = target_logits.shape[1]
    tokens = draft.tokens.tolist()
    if n > 1 and not (0 <= min(tokens[1:]) and max(tokens[1:]) < vocab):
        raise ConfigError(f"draft tokens {tokens} fall outside the target vocabulary [0, {vocab})")
    if draft.draft_probs is not None and tuple(draft.draft_probs.shape) != (n, vocab):
        raise ConfigError(
            f"draft_probs must be [num_nodes={n}, vocab={vocab}] like target_logits, "
            f"got {tuple(draft.draft_probs.shape)}"
        )
    return tokens


def verify(
    draft: Draft, target_logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> Verdict:
    """Accept a path of the draft and emit its tokens plus one bonus/residual token.

    target_logits  # [num_nodes, vocab] float32: row i = the target's logits at draft node i
    generator: randomness for sampling (any device: draws happen there); unused when params.greedy.
    """
    if params.greedy:
        return verify_greedy(draft, target_logits)
    return verify_sampling(draft, target_logits, params, generator)


def verify_greedy(draft: Draft, target_logits: torch.Tensor) -> Verdict:
    """Deepest root-to-node path whose every token equals the target argmax at its parent.

    target_logits  # [num_nodes, vocab]
    Siblings may share a token (e.g. lookup + model candidates); the deepest matching branch wins, ties going
    to the lower node index (rank order). The proposal kind is irrelevant: greedy is exact for any draft.
    """
    _check_inputs(draft, target_logits)
    verdict = greedy_walk(draft, greedy_tokens(target_logits).tolist())
    assert isinstance(verdict, Verdict)  # every argmax is known
    return verdict


def greedy_walk(draft: Draft, argmax: Sequence[int | None]) -> Verdict | list[int]:
    """`verify_greedy` over the target argmax of the nodes whose logits are known (None: not computed): its
    Verdict, or, where the walk needs the argmax of nodes that are not known, those nodes (ascending) to compute
    before walking again. A node's argmax is needed iff it is on the matching path: its children are matched
    against it, or it ends the path (its argmax is then the bonus / residual token).

    argmax  # num_nodes entries
    """
    tokens = draft.tokens.tolist()
    tree = draft.tree
    if len(argmax) != len(tokens):
        raise ConfigError(f"argmax must have one entry per draft node ({len(tokens)}), got {len(argmax)}")
    parents, choices = tree.parent_list, tree.choices
    # One pass in canonical order (parents first; by depth, then rank): node i is on a matching path iff its parent
    # is and its token is the parent's argmax. The first such node at a new depth is the lowest-index deepest one.
    on_path = [True] + [False] * (len(tokens) - 1)
    missing = [] if argmax[0] is not None else [0]
    best, best_depth = 0, 0
    for i in range(1, len(tokens)):
        p = parents[i]
        if not on_path[p] or argmax[p] is None:
            continue
        if tokens[i] == argmax[p]:
            on_path[i] = True
            if argmax[i] is None:
                missing.append(i)
            if len(choices[i - 1]) > best_depth:
                best, best_depth = i, len(choices[i - 1])
    if missing:
        return missing
    path = tree.path(best)
    emitted = [tokens[i] for i in path[1:]] + [argmax[best]]
    return _verdict(list(path), emitted, bonus=tree.is_leaf(best))


def greedy_walk_computing(
    draft: Draft, argmax: list[int | None], argmax_of: Callable[[list[int]], Sequence[int]]
) -> Verdict:
    """`greedy_walk` until it has what it needs: `argmax_of(nodes)` gives the target argmax of nodes it asks for
    (their logits computed now), filled into `argmax` (num_nodes entries, None: not known yet) before it walks again."""
    while not isinstance(verdict := greedy_walk(draft, argmax), Verdict):
        for node, a in zip(verdict, argmax_of(verdict)):
            argmax[node] = a
    return verdict


def likely_path(
    draft: Draft,
    child_logits: torch.Tensor,  # [num_nodes - 1] float32: node i's token's logit at its parent, for i >= 1
) -> list[int]:
    """The nodes whose argmax greedy verification will most likely need: the root, then, below each such node, its
    children carrying the token of its best-scoring child (the matching path if each node's argmax is among its
    children, plus one level below a node whose argmax is not). Where `child_logits` are the target's own, this
    holds every node `greedy_walk` asks for; approximate ones only cost a second pass at a near tie."""
    tokens = draft.tokens.tolist()
    tree = draft.tree
    parents = tree.parent_list
    scores = child_logits.tolist()
    best: dict[int, tuple[float, int]] = {}  # parent -> (its best child's logit, that child's token)
    for i in range(1, len(tokens)):  # first best on ties: the lower node index, as greedy_walk
        p = parents[i]
        if p not in best or scores[i - 1] > best[p][0]:
            best[p] = (scores[i - 1], tokens[i])
    on = [True] + [False] * (len(tokens) - 1)
    for i in range(1, len(tokens)):
        p = parents[i]
        on[i] = on[p] and tokens[i] == best[p][1]
    return [i for i, x in enumerate(on) if x]


def _uniforms(m: int, generator: torch.Generator | None) -> list[float]:
    device = generator.device if generator is not None else "cpu"
    return torch.rand(m, generator=generator, device=device, dtype=torch.float64).tolist()


def verify_sampling(
    draft: Draft, target_logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> Verdict:
    """Tree rejection sampling with the rule of `draft.proposal` (see the module docstring).

    target_logits  # [num_nodes, vocab]
    """
    tokens = _check_inputs(draft, target_logits)
    tree = draft.tree
    proposal = draft.proposal
    node = 0
    path = [0]
    emitted: list[int] = []
    while True:
        p = target_probs(target_logits[node], params)  # [vocab] float32
        kids = tree.children(node)
        if not kids:
            emitted.append(sample(p, generator))
            return _verdict(path, emitted, bonus=True)
        u = _uniforms(len(kids), generator)  # one fresh uniform per child tried
        if proposal is Proposal.DETERMINISTIC:
            child, residual = _try_deterministic(p, kids, tokens, draft.tokens, u)
        else:
            q = draft.draft_probs[node].to(device=p.device, dtype=torch.float32)  # [vocab]
            q = q / q.sum()
            child, residual = _try_stochastic(p, q, kids, tokens, u, node, proposal is Proposal.WITHOUT_REPLACEMENT)
        if residual is not None:  # every child rejected
            emitted.append(sample(residual, generator))
            return _verdict(path, emitted, bonus=False)
        path.append(child)
        emitted.append(tokens[child])
        node = child


def _try_deterministic(
    p: torch.Tensor, kids: tuple[int, ...], tokens: list[int], token_tensor: torch.Tensor, u: list[float]
) -> tuple[int, torch.Tensor | None]:
    """Returns (accepted child, None) or (-1, residual  # [vocab]) once every child is rejected.

    q_c = one-hot(x). The residual after rejecting x_1..x_j is p with those tokens zeroed, renormalised; it is
    kept implicitly as (p, rejected tokens, mass left) so the walk costs one gather. Child x is accepted with
    probability residual(x) = p(x) / (mass left), which is 0 when x was already rejected (a duplicate sibling
    from another candidate source): such a child is rejected with certainty, exactly as the rule requires."""
    kid_tokens = [tokens[c] for c in kids]
    # Siblings are contiguous in canonical order, so their tokens are one slice: a single gather for all p(x).
    px = p[token_tensor[kids[0] : kids[-1] + 1].to(p.device)].tolist()
    left = float(p.sum())
    rejected: set[int] = set()
    for c, x, pxi, ui in zip(kids, kid_tokens, px, u):
        mass_x = 0.0 if x in rejected else pxi
        if left > 0.0 and ui < mass_x / left:
            return c, None
        if x not in rejected:
            rejected.add(x)
            left -= pxi
    residual = p.clone()
    residual[torch.tensor(sorted(rejected), device=p.device)] = 0.0
    if not float(residual.sum()) > 0.0:
        # Only reachable through rounding (the last child's acceptance ratio was 1 - eps): the exact residual has
        # zero mass and this branch has probability zero, so any choice is lossless; keep p.
        return -1, p
    return -1, residual


def _try_stochastic(
    p: torch.Tensor,
    q: torch.Tensor,
    kids: tuple[int, ...],
    tokens: list[int],
    u: list[float],
    node: int,
    without_replacement: bool,
) -> tuple[int, torch.Tensor | None]:
    """IID / without-replacement rules; p, q  # [vocab] float32, both normalised. Returns like _try_deterministic."""
    for c, ui in zip(kids, u):
        x = tokens[c]
        px, qx = float(p[x]), float(q[x])
        if not qx > 0.0:
            raise ConfigError(
                f"draft node {c} (token {x}) has draft probability {qx} at its parent node {node}: a token sampled "
                f"from q cannot have q = 0 (draft_probs do not match the drafted tokens)"
            )
        if ui < px / qx:  # min(1, p/q) is implicit: u < 1 always
            return c, None
        r = (p - q).clamp_min(0.0)
        mass = float(r.sum())
        if mass > 0.0:  # exact zero mass means rejection had probability 0 (rounding): keep p, see above
            p = r / mass
        if without_replacement:
            q = q.clone()
            q[x] = 0.0
            q_mass = float(q.sum())
            if q_mass > 0.0:
                q = q / q_mass
    return -1, p


def _verdict(path: list[int], emitted: list[int], bonus: bool) -> Verdict:
    return Verdict(
        path=torch.tensor(path, dtype=torch.int64), tokens=torch.tensor(emitted, dtype=torch.int64), bonus=bonus
    )


__all__ = ["greedy_walk", "greedy_walk_computing", "likely_path", "verify", "verify_greedy", "verify_sampling"]
