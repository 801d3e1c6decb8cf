"""Prompt lookup decoding (PLD): draft by copying what followed earlier occurrences of the current suffix.

No weights. The suffix of the sequence (prompt + generated + root) is matched against every earlier
occurrence in the committed text, trying n-gram lengths from `max_ngram` down to `min_ngram`; the tokens that
followed each occurrence are proposed. Several distinct continuations (longest n first, then most recent
occurrence first) are merged into a trie, so the draft is a small tree (a chain when only one is found).
Children are fixed candidates, so the proposal is DETERMINISTIC.

The index maps every n-gram of the committed sequence to the positions right after its occurrences and is
extended incrementally on `advance`, so a draft costs O(max_ngram + candidates) dict look-ups regardless of
the sequence length.

With a datastore (`runtime.drafters.datastore`, options.datastore_tokens > 0) one more continuation per step comes
from the target's own earlier answers, matched on this request's answer so far; it is grafted onto the same trie
with its own node budget.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from runtime.draft_spec import DraftSpec, DraftSpecError, DrafterKind, LookupOptions
from runtime.drafters.datastore import DATASTORE_FILE, SEPARATOR, Datastore
from runtime.errors import ConfigError
from runtime.protocol import Draft, Proposal
from runtime.tree import Tree

NAME = "lookup"
# Occurrences looked at per n-gram length and draft (most recent first).
_SCAN_PER_NGRAM = 64


class LookupDrafter:
    """Prompt-lookup drafter; stateless apart from its options (and its read-only datastore, if any)."""

    name = NAME

    def __init__(self, options: LookupOptions | None = None, datastore: Datastore | None = None) -> None:
        self.options = options if options is not None else LookupOptions()
        if self.options.datastore_tokens and datastore is None:
            raise ConfigError(f"lookup option datastore_tokens {self.options.datastore_tokens} needs a datastore")
        self.datastore = datastore if self.options.datastore_tokens else None

    @property
    def spec(self) -> DraftSpec:
        """What it drafts: lookup with its options."""
        return DraftSpec(NAME, lookup=self.options)

    @classmethod
    def merged(cls, options: LookupOptions, head_dir: str, vocab_size: int) -> LookupDrafter:
        """Prompt lookup to merge into a weighted drafter's trees, with the datastore in its head directory when
        `options` asks for one."""
        datastore = None
        if options.datastore_tokens:
            datastore = Datastore.load(Path(head_dir) / DATASTORE_FILE, vocab_size, options.datastore_min_ngram,
                                       options.datastore_max_ngram)
        return cls(options, datastore)

    def start(self, prompt: torch.Tensor, hidden: torch.Tensor | None, max_nodes: int) -> LookupSession:
        """prompt # [P] int64; hidden is ignored (lookup needs no hidden states)."""
        return LookupSession(prompt, max_nodes, self.options, self.datastore)


class LookupSession:
    """Per-request n-gram index over the committed sequence."""

    def __init__(self, prompt: torch.Tensor, max_nodes: int, options: LookupOptions,
                 datastore: Datastore | None = None) -> None:
        if not isinstance(max_nodes, int) or isinstance(max_nodes, bool) or max_nodes < 1:
            raise ConfigError(f"max_nodes must be an integer >= 1 (the root counts), got {max_nodes!r}")
        if prompt.ndim != 1:
            raise ConfigError(f"prompt must be a 1-D token tensor, got shape {tuple(prompt.shape)}")
        self.options = options
        self.max_nodes = max_nodes
        self.tokens: list[int] = []  # the committed sequence x_0 .. x_{L-1}
        # index[n][ngram] = end positions e (exclusive) of the occurrences tokens[e - n : e] == ngram, ascending.
        self.index: dict[int, dict[tuple[int, ...], list[int]]] = {
            n: {} for n in range(options.min_ngram, options.max_ngram + 1)
        }
        self._extend(prompt.tolist())
        self.datastore = datastore
        self.answer_start = len(self.tokens)  # the datastore matches SEPARATOR + tokens[answer_start:] + root

    def _extend(self, new: list[int]) -> None:
        toks = self.tokens
        for tok in new:
            toks.append(int(tok))
            end = len(toks)
            for n, table in self.index.items():
                if end >= n:
                    table.setdefault(tuple(toks[end - n : end]), []).append(end)

    def continuations(self, root: int) -> Iterator[tuple[int, list[int]]]:
        """(n, continuation) of (committed + root) in priority order (longest n-gram, then most recent occurrence),
        n the length of the n-gram matched.

        Each is at most depth_limit tokens; at most _SCAN_PER_NGRAM occurrences are looked at per n-gram length
        so that highly repetitive text cannot make a draft scan the whole sequence.
        """
        opts = self.options
        committed = len(self.tokens)  # the root sits at index `committed` of the sequence
        depth = opts.depth_limit
        for n in range(min(opts.max_ngram, committed + 1), opts.min_ngram - 1, -1):
            suffix = tuple(self.tokens[committed + 1 - n :]) + (root,)
            ends = self.index[n].get(suffix, ())
            for end in ends[: -_SCAN_PER_NGRAM - 1 : -1]:  # most recent first
                cont = self.tokens[end : end + depth]
                if len(cont) < depth:
                    # The occurrence ends within `period` tokens of the sequence end, i.e. the text since it
                    # repeats with that period: continue the repetition (the root included) instead of stopping.
                    period = committed + 1 - end  # >= 1 since end <= committed
                    cycle = self.tokens[end:] + [root]
                    cont = [cycle[i % period] for i in range(depth)]
                yield n, cont

    def stored_continuation(self, root: int) -> list[int]:
        """The datastore's continuation of this request's answer so far + root ([] without a datastore)."""
        if self.datastore is None:
            return []
        opts = self.options
        # Only the last datastore_max_ngram tokens are matched: copy no more of the answer than that.
        start = max(self.answer_start, len(self.tokens) - opts.datastore_max_ngram)
        context = ([SEPARATOR] if start == self.answer_start else []) + self.tokens[start:] + [root]
        return self.datastore.continuation(context[-opts.datastore_max_ngram:], opts.datastore_tokens,
                                           opts.datastore_min_share)

    def draft(self, root: int, params: object = None, generator: torch.Generator | None = None,
              max_nodes: int | None = None) -> Draft:
        opts = self.options
        room = self.max_nodes - 1
        budget = min(opts.num_draft_tokens, room)
        if room == 0:
            return Draft(Tree.root_only(), torch.tensor([int(root)], dtype=torch.int64))
        # Trie keyed by rank paths: children[path] = tokens of the children of `path`, in rank order.
        children: dict[tuple[int, ...], list[int]] = {(): []}
        node_token: dict[tuple[int, ...], int] = {}
        # a node's probability per token, beside a scored drafter's nodes: its first continuation's (the likeliest:
        # longer matches come first and the datastore's last)
        node_logp: dict[tuple[int, ...], float] = {}

        def graft(cont: list[int], budget: int, prob: float) -> int:
            """Add `cont` to the trie (shared prefix kept) with at most `budget` new nodes; the number added."""
            path: tuple[int, ...] = ()
            added = 0
            for tok in cont:
                kids = children[path]
                if tok in kids:
                    path = path + (kids.index(tok),)
                    continue
                if added == budget:
                    break
                kids.append(tok)
                path = path + (len(kids) - 1,)
                children[path] = []
                node_token[path] = tok
                node_logp[path] = math.log(prob)
                added += 1
            return added

        used = 0
        branches = 0
        for n, cont in self.continuations(int(root)):
            added = graft(cont, budget - used, opts.ngram_token_prob(n))
            used += added
            branches += added > 0  # a continuation already in the trie is not a new branch
            if used == budget or branches == opts.max_branches:
                break
        graft(self.stored_continuation(int(root)), min(opts.datastore_tokens, room - used), opts.datastore_token_prob)
        if not node_token:
            return Draft(Tree.root_only(), torch.tensor([int(root)], dtype=torch.int64))
        tree = Tree.from_choices(list(node_token))
        tokens = [int(root)] + [node_token[p] for p in tree.choices]
        # a node's score: the log-probability of its path (its own and its ancestors' per-token probabilities)
        scores = [0.0] + [sum(node_logp[p[:d]] for d in range(1, len(p) + 1)) for p in tree.choices]
        return Draft(tree, torch.tensor(tokens, dtype=torch.int64), Proposal.DETERMINISTIC,
                     scores=torch.tensor(scores, dtype=torch.float32))

    def advance(self, tokens: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        """tokens # [a] int64: the newly committed x_L .. x_{L+a-1}; hidden is ignored."""
        if tokens.ndim != 1:
            raise ConfigError(f"advance tokens must be 1-D, got shape {tuple(tokens.shape)}")
        self._extend(tokens.tolist())


class LookupKind(DrafterKind):
    name = NAME
    title = "prompt lookup"
    options = ("lookup",)
    sized_by = "lookup.num_draft_tokens"

    def check(self, spec: DraftSpec) -> None:
        if spec.tree is not None:
            raise DraftSpecError("tree", f"drafter {NAME!r} builds its own trees from matches; give it options "
                                         "(max_ngram, num_draft_tokens, ...) instead of a tree")

    def shape(self, spec: DraftSpec) -> tuple[int, int]:
        lk = spec.lookup if spec.lookup is not None else LookupOptions()
        return lk.num_draft_tokens + 1, lk.depth_limit

    def load(self, spec: DraftSpec, model: Any) -> LookupDrafter:
        return LookupDrafter(spec.lookup if spec.lookup is not None else LookupOptions())


KIND = LookupKind()
