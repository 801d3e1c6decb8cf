"""The decode loop: prompt in, a stream of token deltas out (draft -> verify -> commit, repeated).

One request owns one KV cache and one drafter session. Each step feeds the draft tree (root first) through the
target in a single forward pass under the tree mask, lets `runtime.verify` keep a lossless prefix of one path,
compacts the cache to that path and hands the committed tokens and their hidden states to the drafter. The
vocabulary (root, accepted / bonus / residual tokens, tau) is defined once in `runtime.protocol`.

Token accounting: the prefill pass emits the first token (sampled from the target at the last prompt
position, no speculation). Every later token comes from a verification step, so
    tau = tokens emitted by verification steps / verification steps  (>= 1; plain decoding gives exactly 1).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from runtime.errors import RequestError
from runtime.model import TargetModel
from runtime.protocol import Draft, Drafter
from runtime.sampling import SamplingParams, sample, target_probs
from runtime.tokenizer import ChatMessage, Tokenizer, is_chat
from runtime.tree import Tree
from runtime.verify import verify


@dataclass(frozen=True)
class GenerationStats:
    """Per-request speculation statistics (times in seconds)."""

    prompt_tokens: int
    generated_tokens: int
    target_forwards: int  # prefill included
    steps: int  # verification steps (target forwards over a draft tree)
    drafted_tokens: int  # draft nodes fed to the target, root excluded
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
        """Accepted draft tokens / drafted tokens (0 when nothing was drafted)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    def to_dict(self) -> dict:
        d = {name: getattr(self, name) for name in self.__dataclass_fields__}
        d["accepted_per_step"] = list(self.accepted_per_step)
        d["acceptance_rate"] = self.acceptance_rate
        return d


@dataclass(frozen=True)
class GenerationDelta:
    """One streamed piece: new token ids and the text they completed (text may lag ids at UTF-8/stop-string
    boundaries; the concatenation of all deltas is the full output)."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None  # "stop" (EOS, stop token or stop string) | "length" | None
    stats: GenerationStats | None = None  # on the final delta only

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


def _prune(draft: Draft, max_depth: int, max_nodes: int) -> Draft:
    """Keep nodes with depth <= max_depth, at most max_nodes of them.

    Canonical order sorts nodes by (depth, path), so every prefix of it is ancestor-closed: pruning is a slice.
    """
    tree = draft.tree
    keep = min(int((tree.depth <= max_depth).sum()), max_nodes)
    if keep == tree.num_nodes:
        return draft
    probs = None if draft.draft_probs is None else draft.draft_probs[:keep]
    return Draft(Tree.from_choices(tree.choices[: keep - 1]) if keep > 1 else Tree.root_only(),
                 draft.tokens[:keep], draft.proposal, probs)


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

    def __init__(self, model: TargetModel, tokenizer: Tokenizer | None, drafter: Drafter, max_tree_nodes: int) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.max_tree_nodes = max_tree_nodes
        eos = model.config.eos_token_ids or (tokenizer.eos_token_ids if tokenizer is not None else ())
        self.eos_token_ids = frozenset(eos)

    @property
    def max_context(self) -> int:
        return self.model.config.max_context

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

    def generate(self, prompt: PromptLike, params: SamplingParams | None = None, **sampling) -> GenerationResult:
        """Run a request to completion (prompt: text, token ids or chat messages, see `encode_prompt`). Sampling
        settings come as a SamplingParams or as its field names (max_tokens=, temperature=, top_k=, top_p=, seed=,
        stop=, stop_token_ids=, ignore_eos=)."""
        ids: list[int] = []
        text = []
        for delta in self.stream(prompt, params, **sampling):
            ids.extend(delta.token_ids)
            text.append(delta.text)
        assert delta.stats is not None and delta.finish_reason is not None
        return GenerationResult(tuple(ids), "".join(text), delta.finish_reason, delta.stats)

    # ---- the loop -----------------------------------------------------------------------------------

    def stream(self, prompt: PromptLike, params: SamplingParams | None = None, **sampling) -> Iterator[GenerationDelta]:
        """Yield GenerationDeltas until a stop condition; the last one carries finish_reason and stats.

        The prompt is validated here, eagerly (RequestError before any iteration); closing the returned
        iterator cancels the request and releases its cache.
        """
        if params is not None and sampling:
            raise RequestError(f"pass sampling settings either as params= or as keywords, not both: {sorted(sampling)}")
        params = params or SamplingParams(**_check_sampling_keys(sampling))
        prompt_ids = self.encode_prompt(prompt)
        return self._run(prompt_ids, params)

    def _run(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[GenerationDelta]:
        clock = _Clock()
        model, device = self.model, self.model.device
        gen = params.new_generator()
        n_prompt = len(prompt_ids)
        # The sequence may grow to max_context tokens (the last emitted token is never fed back).
        limit = min(self.max_context, n_prompt + params.max_tokens)
        cache = model.new_cache(min(self.max_context, limit + self.max_tree_nodes))
        detok = self.tokenizer.detokenizer(skip_special_tokens=True) if self.tokenizer is not None else None
        stops = StopChecker(params.stop)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        generated: list[int] = []
        verification = "none"
        steps = 0

        t0 = time.perf_counter()
        prompt_t = torch.tensor([prompt_ids], dtype=torch.long, device=device)
        logits, hidden = model.prefill(prompt_t, cache)
        root = self._first_token(logits[0, -1], params, gen)
        clock.prefill = time.perf_counter() - t0

        t0 = time.perf_counter()
        session = self.drafter.start(prompt_t[0], hidden[0], self.max_tree_nodes)
        clock.draft += time.perf_counter() - t0

        def finish(reason: str, tail_ids: tuple[int, ...], tail_text: str) -> GenerationDelta:
            stats = GenerationStats(
                prompt_tokens=n_prompt,
                generated_tokens=len(generated),
                target_forwards=steps + 1,
                steps=steps,
                drafted_tokens=clock.drafted,
                accepted_tokens=sum(clock.accepted),
                accepted_per_step=tuple(clock.accepted),
                tau=(len(generated) - 1) / steps if steps else 1.0,
                verification=verification,
                drafter=self.drafter.name,
                time_prefill=clock.prefill,
                time_draft=clock.draft,
                time_verify=clock.verify,
                time_other=clock.other,
                time_total=time.perf_counter() - clock.start,
            )
            return GenerationDelta(tail_ids, tail_text, reason, stats)

        emitted = [root]
        while True:
            # ---- commit the emitted tokens to the output, checking stop conditions in order ----
            t0 = time.perf_counter()
            new_ids: list[int] = []
            reason = None
            for tok in emitted:
                new_ids.append(tok)
                generated.append(tok)
                if tok in stop_ids:
                    reason = "stop"
                    break
                if len(generated) >= params.max_tokens or n_prompt + len(generated) >= self.max_context:
                    reason = "length"
                    break
            piece = detok.add(new_ids) if detok is not None else ""
            if reason is not None and detok is not None:
                piece += detok.flush()
            text, hit = stops.feed(piece)
            if hit:
                reason = "stop"
            elif reason is not None:
                text += stops.flush()
            clock.other += time.perf_counter() - t0
            if reason is not None:
                yield finish(reason, tuple(new_ids), text)
                return
            yield GenerationDelta(tuple(new_ids), text)

            # ---- draft ----
            t0 = time.perf_counter()
            draft = session.draft(generated[-1], params, gen)
            # Never draft past the token budget or the cache: a node at depth d is the (d+1)-th token of the step.
            remaining = min(params.max_tokens - len(generated), self.max_context - n_prompt - len(generated))
            draft = _prune(draft, max_depth=remaining - 1, max_nodes=cache.max_len - cache.length)
            clock.draft += time.perf_counter() - t0

            # ---- verify: one target forward over the whole tree ----
            t0 = time.perf_counter()
            tree = draft.tree
            positions = (cache.length + tree.depth).to(device)[None]
            logits, hidden = model.forward(draft.tokens.to(device)[None], positions, cache, tree.packed_mask.to(device)[None])
            verdict = verify(draft, logits[0], params, gen)
            clock.verify += time.perf_counter() - t0
            if steps == 0:
                verification = "greedy" if params.greedy else f"rejection_sampling/{draft.proposal.value}"
            steps += 1
            clock.drafted += tree.num_nodes - 1
            clock.accepted.append(verdict.num_accepted)

            # ---- commit: compact the cache to the accepted path, tell the drafter ----
            t0 = time.perf_counter()
            path = verdict.path.to(device)
            cache.commit(tree.num_nodes, path)
            clock.other += time.perf_counter() - t0
            t0 = time.perf_counter()
            session.advance(draft.tokens.to(device)[path], hidden[0, path])
            clock.draft += time.perf_counter() - t0
            emitted = verdict.tokens.tolist()

    @staticmethod
    def _first_token(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
        """logits # [V] float32 at the last prompt position."""
        if params.greedy:
            return int(logits.argmax())
        return sample(target_probs(logits, params), gen)


__all__ = ["PromptLike", "SpecDecoder", "GenerationDelta", "GenerationResult", "GenerationStats", "StopChecker"]
