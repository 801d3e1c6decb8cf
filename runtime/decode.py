"""The decode loop: prompt in, a stream of token deltas out (draft -> verify -> commit, repeated).

One request owns one KV cache and one drafter session. Each step feeds the draft tree (root first) through the
target in a single forward pass under the tree mask, lets `runtime.verify` keep a lossless prefix of one path,
compacts the cache to that path and hands the committed tokens and their hidden states to the drafter. The
vocabulary (root, accepted / bonus / residual tokens, tau) is defined once in `runtime.protocol`.

A request's steps live in `RequestState` (prompt chunks, drafting, verification, commit, stop conditions,
detokenisation, stats); the target forward is its caller's. `SpecDecoder.stream` drives one state alone;
`runtime.batching.Scheduler` drives many, verifying all their trees in one target forward.

Token accounting: the prefill pass emits the first token (sampled from the target at the last prompt
position, no speculation). Every later token comes from a verification step, so
    tau = tokens emitted by verification steps / verification steps  (>= 1; plain decoding gives exactly 1).

Speculation counters in vLLM's spec-decode meanings (a tree counts its depth, the positions it speculates):
    drafts = steps; draft positions = sum over steps of the (pruned) tree's depth; accepted = accepted draft
    tokens; acceptance_rate = accepted / draft positions; mean accepted length = 1 + accepted / steps.
`drafted_tokens` counts tree nodes fed to the target (the verification work), not draft positions.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from runtime.draft_spec import DraftSpec
from runtime.errors import RequestError
from runtime.kv_cache import KVCache
from runtime.model import Segment, TargetModel, causal_mask
from runtime.protocol import Draft, Drafter, DraftSession, Verdict, feature_layers_of
from runtime.sampling import Penalties, SamplingParams, greedy_tokens, sample, target_probs, token_logprobs
from runtime.tokenizer import ChatMessage, Tokenizer, is_chat
from runtime.tree import Tree, cost_budget
from runtime.verify import greedy_walk_computing, likely_path, verify
from runtime.verify_cost import verify_cost_for


@dataclass(frozen=True)
class GenerationStats:
    """Per-request speculation statistics (times in seconds)."""

    prompt_tokens: int
    generated_tokens: int
    target_forwards: int  # prefill included (one per prompt chunk)
    steps: int  # verification steps (target forwards over a draft tree)
    drafted_tokens: int  # draft nodes fed to the target, root excluded
    draft_positions: int  # sum over steps of the tree's depth (vLLM's draft tokens: positions speculated)
    accepted_tokens: int  # draft tokens kept by the verifier
    accepted_per_step: tuple[int, ...]  # accepted draft tokens of each step (0 .. tree depth)
    tau: float  # tokens emitted per verification step, bonus/residual included
    verification: str  # "greedy" | "rejection_sampling/<proposal>" | "none" (ended at prefill)
    drafter: str
    time_prefill: float
    time_draft: float
    time_verify: float  # target forward + acceptance
    time_other: float  # cache compaction, detokenisation, stop checks
    time_total: float

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / draft positions (steps x tree depth): the chance a speculated position is
        accepted, vLLM's draft acceptance rate (0 when nothing was drafted). Not per tree node: see
        `drafted_tokens`."""
        return self.accepted_tokens / self.draft_positions if self.draft_positions else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """1 + accepted draft tokens per step (vLLM's mean acceptance length; 1 when no step ran)."""
        return 1.0 + self.accepted_tokens / self.steps if self.steps else 1.0

    @property
    def accepted_per_position(self) -> tuple[int, ...]:
        """[k] = steps whose draft position k + 1 was accepted (vLLM's per-position acceptance counts)."""
        depth = max(self.accepted_per_step, default=0)
        return tuple(sum(1 for a in self.accepted_per_step if a > k) for k in range(depth))

    def to_dict(self) -> dict:
        d = {name: getattr(self, name) for name in self.__dataclass_fields__}
        d["accepted_per_step"] = list(self.accepted_per_step)
        d["acceptance_rate"] = self.acceptance_rate
        d["mean_accepted_length"] = self.mean_accepted_length
        d["accepted_per_position"] = list(self.accepted_per_position)
        return d


@dataclass(frozen=True)
class GenerationDelta:
    """One streamed piece: new token ids and the text they completed (text may lag ids at UTF-8/stop-string
    boundaries; the concatenation of all deltas is the full output)."""

    token_ids: tuple[int, ...]
    text: str
    # "stop" (EOS, stop token or stop string) | "length" | "cancelled" (runtime.batching: cancelled by the caller)
    finish_reason: str | None = None
    stats: GenerationStats | None = None  # on the final delta only
    # With SamplingParams.logprobs set: one entry per token id (see runtime.sampling.token_logprobs).
    logprobs: tuple[float, ...] | None = None
    # per token: (token id, log-probability) of the likeliest alternatives, likeliest first
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class GenerationResult:
    token_ids: tuple[int, ...]  # generated ids only (an EOS / stop token that ended generation included)
    text: str  # special tokens skipped, cut before a stop string
    finish_reason: str
    stats: GenerationStats


@dataclass
class _Clock:
    """Mutable per-request accumulators; frozen into GenerationStats at the end."""

    start: float = field(default_factory=time.perf_counter)
    prefill: float = 0.0
    draft: float = 0.0
    verify: float = 0.0
    other: float = 0.0
    accepted: list[int] = field(default_factory=list)
    drafted: int = 0
    positions: int = 0


def prune_draft(draft: Draft, max_depth: int, max_nodes: int) -> Draft:
    """Keep nodes with depth <= max_depth, at most max_nodes of them: the subtree `Tree.best_nodes` picks (by the
    drafter's path scores when it gives them)."""
    tree = draft.tree
    keep = tree.best_nodes(max_nodes, max_depth, None if draft.scores is None else draft.scores.tolist())
    if len(keep) == tree.num_nodes:
        return draft
    index = torch.tensor(keep, dtype=torch.int64)  # ascending: the kept nodes stay in canonical order
    probs = None if draft.draft_probs is None else draft.draft_probs[index.to(draft.draft_probs.device)]
    scores = None if draft.scores is None else draft.scores[index.to(draft.scores.device)]
    return Draft(tree.subtree(keep), draft.tokens[index.to(draft.tokens.device)], draft.proposal, probs, scores)


class StopChecker:
    """Finds stop strings in streamed text and holds back any tail that could still become one."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""  # everything generated so far
        self._sent = 0

    def feed(self, piece: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit now, stopped)."""
        search_from = max(0, len(self.text) - self._hold)
        self.text += piece
        hits = [i for i in (self.text.find(s, search_from) for s in self._stops) if i >= 0]
        if hits:
            end = min(hits)
            out, self._sent = self.text[self._sent : end], end
            self.text = self.text[:end]
            return out, True
        # Hold back the longest suffix that is a proper prefix of some stop string.
        safe = len(self.text)
        for s in self._stops:
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:k]):
                    safe = min(safe, len(self.text) - k)
                    break
        safe = max(safe, self._sent)
        out, self._sent = self.text[self._sent : safe], safe
        return out, False

    def flush(self) -> str:
        out, self._sent = self.text[self._sent :], len(self.text)
        return out


def _check_sampling_keys(sampling: dict) -> dict:
    known = set(SamplingParams.__dataclass_fields__)
    unknown = sorted(set(sampling) - known)
    if unknown:
        raise RequestError(f"unknown sampling setting(s) {unknown}; expected some of {sorted(known)}")
    return sampling


# A prompt: text, token ids, or chat messages ([{"role": ..., "content": ...}, ...], rendered by the chat template).
PromptLike = str | list[int] | tuple[int, ...] | torch.Tensor | list[dict[str, str]] | tuple[ChatMessage, ...]


class SpecDecoder:
    """A target model, its tokenizer and a drafter: serves any number of sequential or concurrent requests
    (each request gets its own cache and drafter session; the weights are shared and read-only)."""

    def __init__(self, model: TargetModel, tokenizer: Tokenizer | None, drafter: Drafter, max_tree_nodes: int,
                 verify_cost: Sequence[float] | None = None) -> None:
        """verify_cost: cost[n - 1] of a target forward over n nodes relative to one (`runtime.verify_cost`): each
        step's scored tree is cut to the node count that gives the most expected tokens per cost
        (`runtime.tree.cost_budget`); None: trees are verified whole."""
        self.model = model
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.max_tree_nodes = max_tree_nodes
        self.verify_cost = None if verify_cost is None else tuple(float(c) for c in verify_cost)
        # the target layers whose features the drafter reads besides the final-norm state (its hidden states widen)
        self.feature_layers = feature_layers_of(drafter)
        eos = model.config.eos_token_ids or (tokenizer.eos_token_ids if tokenizer is not None else ())
        self.eos_token_ids = frozenset(eos)

    @classmethod
    def for_spec(cls, model: TargetModel, tokenizer: Tokenizer | None, drafter: Drafter,
                 spec: DraftSpec) -> SpecDecoder:
        """The decoder of `drafter`, made from `spec`: trees of at most spec.max_draft_len + 1 nodes, cut by this
        machine's verify cost where the spec's pruning asks for it (`runtime.verify_cost.verify_cost_for`)."""
        nodes = spec.max_draft_len + 1
        return cls(model, tokenizer, drafter, max_tree_nodes=nodes,
                   verify_cost=verify_cost_for(spec.pruning, model, nodes))

    @property
    def max_context(self) -> int:
        return self.model.config.max_context

    def cache_tokens(self, prompt_tokens: int, params: SamplingParams) -> int:
        """The most KV positions a request can ever use: its sequence may grow to prompt + max_tokens tokens (the
        last emitted token is never fed back), with a draft tree on top, all within the context."""
        return min(self.max_context, prompt_tokens + params.max_tokens + self.max_tree_nodes)

    # ---- request boundary ---------------------------------------------------------------------------

    def encode_prompt(self, prompt: PromptLike) -> list[int]:
        """Prompt text, token ids or chat messages -> validated ids (RequestError names the problem).

        Chat messages go through the tokenizer's chat template with the assistant turn opened
        (add_generation_prompt); the template places the special tokens, so no BOS is added to them.
        """
        if is_chat(prompt):
            if self.tokenizer is None:
                raise RequestError("prompt is chat messages but this model has no tokenizer; pass token ids instead")
            ids = self.tokenizer.apply_chat_template(prompt)
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("prompt is text but this model has no tokenizer; pass token ids instead")
            if not prompt:
                raise RequestError("prompt is empty; expected non-empty text, token ids or chat messages")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
        vocab = self.model.config.vocab_size
        if not ids:
            raise RequestError("prompt has no tokens; expected at least one")
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token ids must be ints in [0, {vocab}), got {bad[:5]!r}")
        if len(ids) >= self.max_context:
            raise RequestError(
                f"prompt has {len(ids)} tokens; the context limit is {self.max_context} tokens, so a prompt may "
                f"have at most {self.max_context - 1}"
            )
        return ids

    def request(self, prompt: PromptLike, params: SamplingParams | None = None,
                **sampling) -> tuple[list[int], SamplingParams]:
        """Validate a request: (prompt ids, SamplingParams); settings come as params= or as its field names."""
        if params is not None and sampling:
            raise RequestError(f"pass sampling settings either as params= or as keywords, not both: {sorted(sampling)}")
        params = params or SamplingParams(**_check_sampling_keys(sampling))
        return self.encode_prompt(prompt), params

    def generate(self, prompt: PromptLike, params: SamplingParams | None = None, **sampling) -> GenerationResult:
        """Run a request to completion (prompt: text, token ids or chat messages, see `encode_prompt`). Sampling
        settings come as a SamplingParams or as its field names (max_tokens=, temperature=, top_k=, top_p=, seed=,
        stop=, stop_token_ids=, ignore_eos=)."""
        return collect(self.stream(prompt, params, **sampling))

    # ---- the loop -----------------------------------------------------------------------------------

    def stream(self, prompt: PromptLike, params: SamplingParams | None = None, **sampling) -> Iterator[GenerationDelta]:
        """Yield GenerationDeltas until a stop condition; the last one carries finish_reason and stats.

        The prompt is validated here, eagerly (RequestError before any iteration); closing the returned
        iterator cancels the request and releases its cache.
        """
        prompt_ids, params = self.request(prompt, params, **sampling)
        return self._run(prompt_ids, params)

    def _run(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[GenerationDelta]:
        state = RequestState(self, prompt_ids, params)
        try:
            while True:
                segment = state.next_segment()
                t0 = time.perf_counter()
                ((logits, hidden),) = self.model.forward_segments([segment])
                delta = state.absorb(logits, hidden, time.perf_counter() - t0)
                if delta is not None:
                    yield delta
                    if delta.finished:
                        return
        finally:
            state.release()


def collect(deltas: Iterable[GenerationDelta]) -> GenerationResult:
    """A whole result from a request's deltas (the last one must be final)."""
    ids: list[int] = []
    text = []
    delta = None
    for delta in deltas:
        ids.extend(delta.token_ids)
        text.append(delta.text)
    if delta is None or delta.stats is None or delta.finish_reason is None:
        raise RuntimeError("the request's deltas ended without a final delta")
    return GenerationResult(tuple(ids), "".join(text), delta.finish_reason, delta.stats)


class RequestState:
    """One request's decoding, step by step, with the target forward left to the caller (so that many requests
    can share one: `runtime.batching.Scheduler`; `SpecDecoder.stream` runs one alone):

        while True:
            segment = state.next_segment()            # a prompt chunk, or the drafted (pruned) tree
            logits, hidden = <target forward of segment, alone or packed with others'>
            delta = state.absorb(logits, hidden, s)   # verify + commit; a GenerationDelta (None mid-prompt)
            if delta is not None and delta.finished: break
        state.release()

    It owns the request's KV cache (allocated at its first segment for the prompt and a tree, grown as tokens are
    produced, never beyond `SpecDecoder.cache_tokens`), drafter session, torch.Generator (seeded from params),
    detokenizer, stop conditions and stats. prefill_chunk: the most prompt tokens per segment (None: the whole
    prompt at once).
    """

    def __init__(self, decoder: SpecDecoder, prompt_ids: list[int], params: SamplingParams,
                 prefill_chunk: int | None = None) -> None:
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                          or prefill_chunk < 1):
            raise RequestError(f"prefill_chunk must be None or an int >= 1, got {prefill_chunk!r}")
        self.clock = _Clock()
        self.decoder = decoder
        self.params = params
        model = decoder.model
        self.device = model.device
        self.generator = params.new_generator()
        self.prompt = torch.tensor(prompt_ids, dtype=torch.long, device=self.device)  # [P]
        self.prompt_tokens = len(prompt_ids)
        self.cache_tokens = decoder.cache_tokens(self.prompt_tokens, params)  # the most KV positions it may use
        self.cache: KVCache | None = None  # allocated by the first next_segment(), dropped by release()
        self._released = False
        tokenizer = decoder.tokenizer
        self._detok = tokenizer.detokenizer(skip_special_tokens=True) if tokenizer is not None else None
        self._stops = StopChecker(params.stop)
        self._stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(decoder.eos_token_ids))
        self._penalties = (Penalties(params, prompt_ids, model.config.vocab_size, self._stop_ids, self.device)
                           if params.penalised else None)
        self._rows: torch.Tensor | None = None  # [n, V] (penalised) logits the last emitted tokens were drawn from
        self._chunk = prefill_chunk or self.prompt_tokens
        self.generated: list[int] = []
        self.session: DraftSession | None = None
        self.verification = "none"
        self.steps = 0
        self.finish_reason: str | None = None
        self._prefilled = 0  # prompt tokens committed to the cache
        self._prefill_forwards = 0
        self._prompt_hidden: list[torch.Tensor] = []  # [n, H] per prompt chunk, until the drafter starts
        self._pending: Draft | int | None = None  # the last segment handed out: its draft, or a chunk's size
        self._logit_rows: list[int] | None = None  # the pending tree's nodes whose logits its forward computes

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def kv_bytes(self) -> int:
        """Bytes of KV cache this request holds now (0 once released)."""
        return 0 if self.cache is None else self.cache.nbytes

    # ---- the two phases of a step -------------------------------------------------------------------

    @property
    def decoding(self) -> bool:
        """Its prompt is in the cache: its next segment is a draft tree (until it finishes)."""
        return self.session is not None and not self.finished

    def next_segment(self, max_nodes: int | None = None) -> Segment:
        """The tokens of this request's next target forward: the next prompt chunk, else a drafted tree (drafting
        happens here), its cache grown to hold them. max_nodes caps the tree (root included; `Tree.best_nodes`
        picks what stays): the scheduler's share of its step budget. 1: a plain step, the drafter is not run."""
        if self.finished or self._released or self._pending is not None:
            raise RuntimeError("next_segment() after the request finished, or twice without absorb()")
        if self.cache is None:  # room for the prompt and a tree; grown as tokens are produced
            self.cache = self.decoder.model.new_cache(
                self.cache_tokens, capacity=min(self.cache_tokens, self.prompt_tokens + self.decoder.max_tree_nodes))
        cache = self.cache
        if self._prefilled < self.prompt_tokens:
            a = self._prefilled
            b = min(self.prompt_tokens, a + self._chunk)
            n = b - a
            cache.reserve(cache.length + n)
            self._pending = n
            # Only the prompt's last row needs logits (the first generated token).
            return Segment(cache, self.prompt[a:b], torch.arange(a, b, device=self.device),
                           causal_mask(n, 1, self.device)[0], logits_from=n - 1 if b == self.prompt_tokens else n,
                           feature_layers=self.decoder.feature_layers)
        if max_nodes is not None and (isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1):
            raise RequestError(f"max_nodes must be None or an int >= 1 (the root counts), got {max_nodes!r}")
        t0 = time.perf_counter()
        root = self.generated[-1]
        if max_nodes == 1:  # the drafter's sessions accept advance() without a draft before it
            draft = Draft(Tree.root_only(), torch.tensor([root], dtype=torch.int64))
        else:
            draft = self.session.draft(root, self.params, self.generator, max_nodes)
        # Never draft past the token budget or the cache: a node at depth d is the (d+1)-th token of the step.
        remaining = min(self.params.max_tokens - len(self.generated),
                        self.decoder.max_context - self.prompt_tokens - len(self.generated))
        room = cache.max_len - cache.length
        budget = room if max_nodes is None else min(room, max_nodes)
        costs = self.decoder.verify_cost
        if costs is not None and draft.scores is not None and draft.tree.num_nodes > 1:
            budget = min(budget, cost_budget(draft.tree.parent_list, draft.scores.tolist(), costs))
        draft = prune_draft(draft, max_depth=remaining - 1, max_nodes=budget)
        self.clock.draft += time.perf_counter() - t0
        tree = draft.tree
        cache.reserve(cache.length + tree.num_nodes)
        self._pending = draft
        # Greedy verification reads the logits of the nodes on the matching path only: the forward computes those
        # it most likely needs (a few rows of the lm_head instead of one per node; absorb computes any other).
        # Penalties and logprobs read other rows' logits: all of them then.
        lazy = tree.num_nodes > 1 and self.params.greedy and self._penalties is None and self.params.logprobs is None
        return Segment(cache, draft.tokens.to(self.device), (cache.length + tree.depth).to(self.device),
                       tree.packed_mask.to(self.device), logit_rows=self._likely_rows if lazy else None,
                       feature_layers=self.decoder.feature_layers)

    def _likely_rows(self, hidden: torch.Tensor) -> torch.Tensor:  # hidden [N, H] -> node indices [M] int64
        """The pending tree's nodes whose argmax greedy verification will likely read (`runtime.verify.likely_path`),
        each child scored by its token's logit at its parent (a dot product per node, not a vocabulary's worth)."""
        draft = self._pending
        tree = draft.tree
        weight = self.decoder.model.lm_head_weight  # [V, H]
        parents = torch.tensor(tree.parent_list[1:], dtype=torch.int64, device=hidden.device)  # [N - 1]
        child_logits = (hidden[parents].float() * weight[draft.tokens[1:].to(weight.device)].float()).sum(-1)
        self._logit_rows = likely_path(draft, child_logits)
        return torch.tensor(self._logit_rows, dtype=torch.int64, device=hidden.device)

    def absorb(
        self,
        logits: torch.Tensor,  # [M, V] float32: the target's logits for the last segment's rows (logits_from or
        #                        logit_rows)
        hidden: torch.Tensor,  # [N, H]: its hidden states (wider with the drafter's feature layers: the segment's)
        forward_seconds: float,  # the target forward's time, charged to prefill / verify
    ) -> GenerationDelta | None:
        """Commit the target's output for the last `next_segment()`; the tokens it emits (None after a prompt
        chunk that is not the last)."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("absorb() without a pending segment")
        clock, device = self.clock, self.device
        if isinstance(pending, int):  # a prompt chunk
            self.cache.advance(pending)
            self._prefilled += pending
            self._prefill_forwards += 1
            self._prompt_hidden.append(hidden)
            clock.prefill += forward_seconds
            if self._prefilled < self.prompt_tokens:
                return None
            t0 = time.perf_counter()
            last = logits[-1:]  # [1, V]
            if self._penalties is not None:  # a one-node tree: the prompt is the whole context
                last = self._penalties.apply(last, torch.zeros(1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool),
                                             torch.zeros(1, dtype=torch.long))
            root = _first_token(last[0], self.params, self.generator)
            self._rows = last
            clock.prefill += time.perf_counter() - t0
            t0 = time.perf_counter()
            prompt_hidden = self._prompt_hidden[0] if len(self._prompt_hidden) == 1 else torch.cat(self._prompt_hidden)
            self._prompt_hidden = []
            self.session = self.decoder.drafter.start(self.prompt, prompt_hidden, self.decoder.max_tree_nodes)
            clock.draft += time.perf_counter() - t0
            return self._emit([root])

        draft = pending
        tree = draft.tree
        t0 = time.perf_counter()
        rows, self._logit_rows = self._logit_rows, None
        if rows is not None:
            verdict = self._verify_rows(draft, rows, logits, hidden)
        else:
            if self._penalties is not None:  # every node against its own path: p stays the (penalised) target
                logits = self._penalties.apply(logits, draft.tokens, tree.mask, tree.depth)
            verdict = verify(draft, logits, self.params, self.generator)
        if self.params.logprobs is not None:
            self._rows = logits[verdict.path.to(logits.device)]  # emitted token k was drawn at path[k]
        clock.verify += forward_seconds + time.perf_counter() - t0
        if self.steps == 0:
            self.verification = "greedy" if self.params.greedy else f"rejection_sampling/{draft.proposal.value}"
        self.steps += 1
        clock.drafted += tree.num_nodes - 1
        clock.positions += tree.max_depth
        clock.accepted.append(verdict.num_accepted)

        # compact the cache to the accepted path, tell the drafter
        t0 = time.perf_counter()
        path = verdict.path.to(device)
        self.cache.commit(tree.num_nodes, path)
        clock.other += time.perf_counter() - t0
        t0 = time.perf_counter()
        self.session.advance(draft.tokens.to(device)[path], hidden[path])
        clock.draft += time.perf_counter() - t0
        return self._emit(verdict.tokens.tolist())

    def _verify_rows(
        self,
        draft: Draft,
        rows: list[int],  # the nodes whose logits the forward computed
        logits: torch.Tensor,  # [len(rows), V] float32
        hidden: torch.Tensor,  # [N, H] (or wider: its first H columns are the final-norm states)
    ) -> Verdict:
        """Greedy verification from the logits of some nodes: the lm_head runs on any other node the walk needs
        (a child whose token scored within rounding of a sibling's), the same rows' logits plain decoding gets."""
        argmax: list[int | None] = [None] * draft.tree.num_nodes
        for r, a in zip(rows, greedy_tokens(logits).tolist()):
            argmax[r] = a

        def argmax_of(nodes: list[int]) -> list[int]:
            index = torch.tensor(nodes, dtype=torch.int64, device=hidden.device)
            final = hidden[index, : self.decoder.model.config.hidden_size]
            return greedy_tokens(self.decoder.model.lm_head(final)).tolist()

        return greedy_walk_computing(draft, argmax, argmax_of)

    # ---- output -------------------------------------------------------------------------------------

    def _emit(self, emitted: list[int]) -> GenerationDelta:
        """Add emitted tokens to the output, checking the stop conditions in order."""
        t0 = time.perf_counter()
        new_ids: list[int] = []
        reason = None
        for tok in emitted:
            new_ids.append(tok)
            self.generated.append(tok)
            if tok in self._stop_ids:
                reason = "stop"
                break
            if len(self.generated) >= self.params.max_tokens or \
                    self.prompt_tokens + len(self.generated) >= self.decoder.max_context:
                reason = "length"
                break
        if self._penalties is not None:
            self._penalties.add(new_ids)
        logprobs = self._logprobs(new_ids)
        detok = self._detok
        piece = detok.add(new_ids) if detok is not None else ""
        if reason is not None and detok is not None:
            piece += detok.flush()
        text, hit = self._stops.feed(piece)
        if hit:
            reason = "stop"
        elif reason is not None:
            text += self._stops.flush()
        self.clock.other += time.perf_counter() - t0
        if reason is None:
            return GenerationDelta(tuple(new_ids), text, None, None, *logprobs)
        self.finish_reason = reason
        return GenerationDelta(tuple(new_ids), text, reason, self.stats(), *logprobs)

    def _logprobs(self, ids: list[int]) -> tuple:
        """(logprobs, top_logprobs) of emitted tokens, or (None, None) when the request did not ask."""
        top = self.params.logprobs
        if top is None:
            return None, None
        chosen, alternatives = token_logprobs(self._rows[: len(ids)], torch.tensor(ids), self.params, top)
        return tuple(chosen), tuple(tuple(a) for a in alternatives)

    def cancel(self) -> GenerationDelta:
        """End the request here: its final delta (finish_reason "cancelled", no new tokens, its stats)."""
        self.finish_reason = "cancelled"
        return GenerationDelta((), "", "cancelled", self.stats())

    def release(self) -> None:
        """Drop the cache and drafter session (their memory); the state cannot step afterwards."""
        self._released = True
        self.cache = None
        self.session = None
        self._prompt_hidden = []

    def stats(self) -> GenerationStats:
        clock, steps, n = self.clock, self.steps, len(self.generated)
        return GenerationStats(
            prompt_tokens=self.prompt_tokens,
            generated_tokens=n,
            target_forwards=steps + self._prefill_forwards,
            steps=steps,
            drafted_tokens=clock.drafted,
            draft_positions=clock.positions,
            accepted_tokens=sum(clock.accepted),
            accepted_per_step=tuple(clock.accepted),
            tau=(n - 1) / steps if steps else 1.0,
            verification=self.verification,
            drafter=self.decoder.drafter.name,
            time_prefill=clock.prefill,
            time_draft=clock.draft,
            time_verify=clock.verify,
            time_other=clock.other,
            time_total=time.perf_counter() - clock.start,
        )


def _first_token(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """logits # [V] float32 at the last prompt position."""
    if params.greedy:
        return int(greedy_tokens(logits))
    return sample(target_probs(logits, params), gen)


__all__ = [
    "PromptLike",
    "SpecDecoder",
    "RequestState",
    "GenerationDelta",
    "GenerationResult",
    "GenerationStats",
    "StopChecker",
    "collect",
    "prune_draft",
]
