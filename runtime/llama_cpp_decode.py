"""Greedy decoding with llama.cpp as the target (`plugins.llama_cpp`): plain, and speculative with a drafter that
needs no target hidden states (prompt lookup), each drafted tree verified in one llama.cpp decode.

Exactness. llama.cpp computes a token's logits bit-identically whatever else a batch holds, as long as every token
it attends to sits in the KV cell numbered by its position (plugins/llama_cpp says why). The loop keeps the cache
as cells 0..P-1 = positions 0..P-1 and feeds, each step, one contiguous run

    r, u_1 .. u_m        at positions P .. P+m: r confirmed, u_1..u_m believed but not yet confirmed
    the drafted tree     rooted at the run's last token, its other nodes in the cells after it

The run's logits are exact. u_1 is confirmed iff argmax(logits at r) == u_1, u_2 iff argmax(logits at u_1) == u_2,
and so on; the first mismatch replaces the rest by the exact argmax (a rounding-level near-tie in the tree's
logits: rare). Then the tree is walked (`runtime.verify.verify_greedy`): its first accepted token is checked
against the run's last, exact, logits, so it is confirmed and becomes the next r; the deeper accepted tokens and
the bonus were checked against tree logits and become the next step's u. Every emitted token is therefore the
argmax of exact logits of its predecessor: greedy output equals `plain_greedy` token for token, by construction.
The price is re-decoding the m believed tokens once (m + N rows per step instead of N).

Tokens are emitted as they are confirmed; both loops generate exactly `max_tokens` tokens (no stop on an end
token: the fixed-length comparison `perf llama-exec` makes).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from plugins.llama_cpp import LlamaCppError, LlamaCppExecutor
from runtime.decode import prune_draft
from runtime.protocol import Draft, Drafter, feature_layers_of
from runtime.sampling import SamplingParams
from runtime.verify import verify_greedy

COMMITTED = 0  # the committed sequence's id; a tree's leaves get 1, 2, ...
GREEDY = SamplingParams()  # what the drafters are told they draft for


@dataclass(frozen=True)
class ExternalStats:
    decodes: int  # llama.cpp decode calls after the prefill
    emitted_per_decode: tuple[int, ...]  # tokens confirmed by each of those calls
    corrections: int  # believed tokens that exact logits replaced
    prefill_s: float
    decode_s: float  # everything after the prefill: drafting included
    draft_s: float = 0.0  # the drafter's share of decode_s (its draft and advance calls)
    drafted: int = 0  # tree nodes verified, roots excluded

    @property
    def tau(self) -> float:
        return sum(self.emitted_per_decode) / max(1, self.decodes)


@dataclass(frozen=True)
class ExternalResult:
    token_ids: tuple[int, ...]
    stats: ExternalStats

    @property
    def seconds(self) -> float:
        return self.stats.prefill_s + self.stats.decode_s


def argmax(row: np.ndarray) -> int:  # row [vocab]
    """The greedy token: the first index of the largest logit (the rule of `runtime.sampling.greedy_tokens`)."""
    return int(np.argmax(row))


def _decode(ex: LlamaCppExecutor, tokens: list[int], positions: list[int], seqs: list[tuple[int, ...]],
            outputs: list[bool]) -> tuple[np.ndarray, np.ndarray | None]:
    """ex.decode, never over fewer than two rows nor with fewer than two outputs: else one more token of the padding
    sequence, an output too, dropped afterwards. One row takes other matmul kernels, which sum in another order, and
    llama.cpp runs its last layer's feed-forward and lm_head over the output rows only (see plugins/llama_cpp)."""
    if len(tokens) >= 2 and sum(outputs) >= 2:
        return ex.decode(tokens, positions, seqs, outputs)
    logits, hidden = ex.decode([*tokens, 0], [*positions, 0], [*seqs, (ex.pad_seq,)], [*outputs, True])
    ex.seq_rm(ex.pad_seq)
    return logits[:-1], (None if hidden is None else hidden[:-1])


def prefill(ex: LlamaCppExecutor, prompt: list[int], hidden: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """Clear the cache and decode the prompt into cells 0..P-1 (chunks of n_batch): the last token's logits [vocab],
    and, with `hidden` on an executor that gives hidden states, every prompt token's [P, hidden] (a drafter's `start`
    reads them; llama.cpp then computes every prompt row's logits too), else None."""
    if not prompt:
        raise LlamaCppError("prefill: the prompt has no tokens")
    if len(prompt) >= ex.n_ctx:
        raise LlamaCppError(f"prefill: a {len(prompt)}-token prompt does not fit n_ctx {ex.n_ctx}")
    ex.clear()
    step = ex.config.n_batch
    every = hidden and ex.config.hidden
    logits, states = None, []
    for start in range(0, len(prompt), step):
        chunk = prompt[start:start + step]
        last = start + len(chunk) == len(prompt)
        logits, h = _decode(ex, chunk, list(range(start, start + len(chunk))), [(COMMITTED,)] * len(chunk),
                            [every or (last and i == len(chunk) - 1) for i in range(len(chunk))])
        if every:
            states.append(h)
    return logits[-1], (np.concatenate(states) if every else None)


def plain_greedy(ex: LlamaCppExecutor, prompt: list[int], max_tokens: int) -> ExternalResult:
    """Plain greedy decoding: one token per decode."""
    t0 = time.perf_counter()
    token = argmax(prefill(ex, prompt)[0])
    t1 = time.perf_counter()
    out = [token]
    while len(out) < max_tokens:
        pos = len(prompt) + len(out) - 1
        token = argmax(_decode(ex, [token], [pos], [(COMMITTED,)], [True])[0][0])
        out.append(token)
    t2 = time.perf_counter()
    n = len(out) - 1
    return ExternalResult(tuple(out[:max_tokens]), ExternalStats(n, (1,) * n, 0, t1 - t0, t2 - t1))


def leaf_sequences(parents: Sequence[int]) -> list[tuple[int, ...]]:
    """Each node's sequences for a tree given by its parent list (root -1, parents before children): those of the
    leaves under it, leaf k (in node order) being sequence k + 1."""
    is_parent = set(parents)
    seqs: list[set[int]] = [set() for _ in parents]
    for k, leaf in enumerate(i for i in range(len(parents)) if i not in is_parent):
        node = leaf
        while node >= 0:
            seqs[node].add(k + 1)
            node = parents[node]
    return [tuple(sorted(x)) for x in seqs]


def decode_tree(ex: LlamaCppExecutor, tokens: list[int], positions: list[int], seqs: list[tuple[int, ...]],
                outputs: list[bool]) -> tuple[np.ndarray, np.ndarray | None]:
    """`_decode` of tokens in leaf sequences as well as the committed one: each leaf sequence holds the committed
    tokens for the decode (seq_cp) and nothing after it (seq_rm), so a node sees the committed tokens and its
    ancestors only; what the batch wrote into the committed sequence stays."""
    leaves = sorted({q for s in seqs for q in s} - {COMMITTED})
    for q in leaves:
        ex.seq_cp(COMMITTED, q)
    try:
        return _decode(ex, tokens, positions, seqs, outputs)
    finally:
        for q in leaves:
            ex.seq_rm(q)


def _rows(hidden: np.ndarray | None, index: list[int], dtype: torch.dtype) -> torch.Tensor | None:
    return None if hidden is None else torch.from_numpy(hidden[index]).to(dtype)  # [len(index), H]


def speculative_greedy(ex: LlamaCppExecutor, drafter: Drafter, prompt: list[int], max_tokens: int,
                       max_nodes: int, hidden_dtype: torch.dtype = torch.float32) -> ExternalResult:
    """Greedy speculative decoding with `drafter`'s trees (at most max_nodes nodes, root included; at most n_seq - 1,
    as each leaf is a sequence); output identical to `plain_greedy`'s (module docstring). A drafter that reads
    hidden states (EAGLE, Medusa) needs an executor opened with `hidden`; they reach it in `hidden_dtype`."""
    layers = feature_layers_of(drafter)
    if layers:
        raise LlamaCppError(f"drafter {drafter.name!r} reads the target's layers {list(layers)}; llama.cpp gives the "
                            "final-norm hidden state only")
    if not 1 <= max_nodes <= ex.config.n_seq - 1:
        raise LlamaCppError(f"max_nodes: got {max_nodes}, expected 1..{ex.config.n_seq - 1} (n_seq - 1: each leaf "
                            "is a sequence, and two are the committed and the padding ones)")
    t0 = time.perf_counter()
    last, prompt_hidden = prefill(ex, prompt, hidden=True)
    r = argmax(last)
    t1 = time.perf_counter()
    history = list(prompt)  # the cache's tokens, all confirmed: cells 0..P-1
    history_hidden = [] if prompt_hidden is None else [prompt_hidden]  # their exact hidden states, when given

    def restart():  # a session over the whole confirmed history
        h = None if prompt_hidden is None else torch.from_numpy(np.concatenate(history_hidden)).to(hidden_dtype)
        return drafter.start(torch.tensor(history, dtype=torch.long), h, max_nodes)

    session = restart()
    fed = len(history)  # tokens the session has seen: history, then the accepted tokens of the last step
    emitted = [r]
    believed: list[int] = []  # u_1 .. u_m
    per_decode: list[int] = []
    corrections = 0
    drafting = 0.0
    drafted = 0
    while len(emitted) < max_tokens:
        run = [r, *believed]
        P = len(history)
        t_draft = time.perf_counter()
        draft = prune_draft(session.draft(run[-1], GREEDY, None, max_nodes), ex.n_ctx, max_nodes)
        drafting += time.perf_counter() - t_draft
        drafted += draft.tree.num_nodes - 1
        node_seqs = leaf_sequences(draft.tree.parent_list)
        everyone = (COMMITTED, *node_seqs[0])  # the run: committed, and seen by every node
        base = P + len(run) - 1  # the tree root's position
        tokens = run + draft.tokens[1:].tolist()
        positions = list(range(P, base + 1)) + [base + d for d in draft.tree.depth[1:].tolist()]
        seqs = [everyone] * len(run) + node_seqs[1:]
        logits, hidden = decode_tree(ex, tokens, positions, seqs, [True] * len(tokens))
        exact = [argmax(logits[j]) for j in range(len(run))]
        mismatch = next((j for j in range(len(run) - 1) if exact[j] != run[j + 1]), None)
        if mismatch is not None:
            # run[0..mismatch] stand; the rest was believed on tree logits that a near-tie flipped.
            kept = run[:mismatch + 1]
            ex.seq_rm(COMMITTED, P + len(kept))
            emitted.extend(kept[1:])
            per_decode.append(len(kept))
            corrections += 1
            history += kept
            if hidden is not None:
                history_hidden.append(hidden[:len(kept)])
            r, believed = exact[mismatch], []
            emitted.append(r)
            session = restart()
            fed = len(history)
            continue
        emitted.extend(believed)
        history += run
        if hidden is not None:
            history_hidden.append(hidden[:len(run)])
        verdict = verify_greedy(draft, torch.from_numpy(logits[len(run) - 1:]))
        path = verdict.path.tolist()  # tree nodes, root first
        # The session learns the run's tokens it has not seen, then this step's accepted ones (their hidden states
        # from the tree rows); the bonus / residual token is the next draft's root.
        new_run = list(range(len(run) - (len(history) - fed), len(run)))
        accepted_rows = [len(run) - 1 + node for node in path[1:]]
        t_draft = time.perf_counter()
        session.advance(torch.tensor([tokens[i] for i in new_run + accepted_rows], dtype=torch.long),
                        _rows(hidden, new_run + accepted_rows, hidden_dtype))
        drafting += time.perf_counter() - t_draft
        fed = len(history) + len(path) - 1
        new = verdict.tokens.tolist()  # accepted tokens, then the bonus / residual token
        r, believed = new[0], new[1:]
        emitted.append(r)
        per_decode.append(len(run))
    t2 = time.perf_counter()
    return ExternalResult(tuple(emitted[:max_tokens]),
                          ExternalStats(len(per_decode), tuple(per_decode), corrections, t1 - t0, t2 - t1,
                                        drafting, drafted))


__all__ = ["ExternalResult", "ExternalStats", "argmax", "decode_tree", "leaf_sequences", "plain_greedy", "prefill",
           "speculative_greedy"]
