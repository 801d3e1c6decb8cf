"""Replay merge rules exactly: the tau of EAGLE-2 + prompt lookup / datastore variants without decoding each one.

Greedy output does not depend on the draft, so a variant's steps are fixed by the answer and its trees alone.
`record` decodes each prompt once (plain decoding), runs the target over prompt + answer in one forward for its
hidden states, and at every answer position keeps the EAGLE-2 head's whole candidate pool (unpruned; the head is
the expensive part). `replay` then walks each answer as the decoder would: the step rooted at answer[j] drafts the
tree `MergedSession.draft` makes (the one home of the merge rule) from that pool, pruned at the variant's floor, and
the variant's lookup / datastore continuations; it accepts the longest drafted prefix of the rest of the answer, and
the next step is rooted one token after it. Drafted features come from a prefill rather than from tree steps, so in
bfloat16 a near-tie in the head can go the other way: on SmolLM2 the replayed tau matched decoding within 0.004.
Near the end of an answer each tree is cut to the tokens left, as the decoder cuts it (`runtime.decode.prune_draft`).

    python -m perf.merge_replay --config configs/smollm2.yaml --prompts FILE.jsonl --max-tokens 128 \\
        --drafters "eagle-2=eagle:dynamic+total_tokens=16+top_k=8+depth=6+num_draft_tokens=30+max_branches=3+..."
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runtime.decode import SpecDecoder, prune_draft
from runtime.draft_spec import DYNAMIC, DraftSpec
from runtime.drafters import load_drafter
from runtime.drafters.merged import MergedDrafter
from runtime.errors import ConfigError
from runtime.files import shown_path
from runtime.protocol import Draft
from runtime.tree import CandidatePool, pruned_pool
from runtime.verify import greedy_walk_computing


@dataclass(frozen=True)
class Recording:
    """One prompt's greedy answer and the head's candidates at each of its positions."""

    prompt: tuple[int, ...]  # the encoded prompt
    answer: tuple[int, ...]  # the greedy answer
    pools: tuple[CandidatePool, ...]  # pools[j]: the head's whole pool below root answer[j] (len(answer) - 1 of them)


def pool_key(spec: DraftSpec) -> tuple[Any, ...]:
    """What a recording's pools depend on: the head, its dynamic tree's shape, its quantization, the node budget."""
    return (spec.path, spec.dynamic, spec.quantization, spec.max_draft_len)


def _check(spec: DraftSpec) -> None:
    if spec.tree != DYNAMIC:  # the dynamic tree's drafters offer their whole candidate pool
        raise ConfigError(f"merge replay takes EAGLE-2 drafters (a dynamic tree), got {spec.describe()!r}")


def record(model: Any, spec: DraftSpec, prompts: Sequence[list[int]], max_tokens: int, max_nodes: int,
           advance: Callable[[], None] | None = None) -> list[Recording]:
    """model: a runtime TargetModel; spec: an EAGLE-2 drafter (its lookup and pruning are ignored: every candidate is
    kept); prompts: encoded; max_nodes: the decoder's tree budget, root included (`max_draft_len + 1`). advance() is
    called after each position (progress)."""
    _check(spec)
    head = load_drafter(dataclasses.replace(spec, lookup=None, pruning=None), model)
    plain = SpecDecoder(model, None, load_drafter(DraftSpec(), model), max_tree_nodes=1)
    out = []
    with torch.no_grad():
        for prompt in prompts:
            answer = list(plain.generate(list(prompt), max_tokens=max_tokens, ignore_eos=True).token_ids)
            seq = list(prompt) + answer
            hidden = model.prefill(torch.tensor([seq]), model.new_cache(len(seq)))[1][0]  # [len(seq), H]
            pools = []
            for j in range(len(answer) - 1):
                i = len(prompt) + j
                session = head.start(torch.tensor(seq[:i]), hidden[:i], max_nodes)
                pool = session.candidates(seq[i], None, None)
                pools.append(CandidatePool(pool.parents.cpu(), pool.tokens.cpu(), pool.scores.float().cpu()))
                if advance is not None:
                    advance()
            out.append(Recording(tuple(prompt), tuple(answer), tuple(pools)))
    return out


class _RecordedHead:
    """A draft session whose candidates are a recording's (pruned at the variant's floor): what MergedSession merges."""

    def __init__(self, recording: Recording, min_score: float | None) -> None:
        self.recording = recording
        self.min_score = min_score
        self.position = 0  # the answer index of the next root

    def candidates(self, root: int, params: object = None, generator: object = None,
                   max_nodes: int | None = None) -> CandidatePool:
        assert root == self.recording.answer[self.position], "the replay roots each step at the answer's token"
        pool = self.recording.pools[self.position]
        return pool if self.min_score is None else pruned_pool(pool, self.min_score)

    def advance(self, tokens: torch.Tensor, hidden: Any) -> None:
        self.position += int(tokens.shape[0])


def _accepted(draft: Draft, rest: Sequence[int]) -> int:
    """How many drafted tokens greedy verification keeps when the target's greedy continuation is `rest`: the
    verifier's own walk (`greedy_walk_computing`), a node's argmax being the answer's token after it (-1, matching
    nothing, past its end)."""
    depth = [0] + [len(c) for c in draft.tree.choices]
    verdict = greedy_walk_computing(draft, [None] * draft.tree.num_nodes,
                                    lambda nodes: [rest[depth[n]] if depth[n] < len(rest) else -1 for n in nodes])
    return verdict.num_accepted


def replay(recordings: Sequence[Recording], drafter: MergedDrafter, max_nodes: int) -> list[list[int]]:
    """Each recording's accepted draft tokens per step for a loaded EAGLE-2 + lookup drafter (its spec's pruning
    floor; its head is not run: the recorded pools stand in for it) under a tree budget of max_nodes (root
    included; record's)."""
    spec = drafter.spec
    _check(spec)
    if not isinstance(drafter, MergedDrafter):
        raise ConfigError(f"merge replay needs a drafter that merges prompt lookup, got {spec.describe()!r}")
    budget = drafter.node_budget(max_nodes)
    out = []
    for rec in recordings:
        head = _RecordedHead(rec, drafter.primary.min_score)  # the head's own floor (None: no pruning)
        session = drafter.join(head, torch.tensor(rec.prompt), budget)
        steps, j, last = [], 0, len(rec.answer) - 1
        while j < last:
            # j + 1 tokens are out; the step's tokens (accepted + the bonus) may not pass the answer's length
            draft = prune_draft(session.draft(rec.answer[j], None, None), max_depth=last - j - 1, max_nodes=budget)
            a = _accepted(draft, rec.answer[j + 1 : last + 1])
            steps.append(a)
            session.advance(torch.tensor(rec.answer[j : j + a + 1]), None)
            j += a + 1
        out.append(steps)
    return out


def tau(steps: Sequence[Sequence[int]]) -> float:
    """Tokens per step over all recordings' steps (accepted + 1 each)."""
    flat = [a for s in steps for a in s]
    return (sum(flat) + len(flat)) / len(flat)


def main(argv: Sequence[str] | None = None) -> int:
    from tqdm import tqdm

    from perf.bench import BenchConfig, encode_prompts, load_target, parse_specs, resolve
    from perf.prompt_sets import load_prompts

    p = argparse.ArgumentParser(prog="python -m perf.merge_replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, required=True, help="builder YAML (its target, head and node limit)")
    p.add_argument("--prompts", type=Path, nargs="+", required=True, help="prompt files (JSON Lines)")
    p.add_argument("--drafters", required=True, help="comma-separated [NAME=]eagle:dynamic+... variants")
    p.add_argument("--max-tokens", type=int, default=BenchConfig.max_tokens, help="answer tokens per prompt")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: every usable core)")
    p.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    args = p.parse_args(argv)
    config = BenchConfig(config=args.config, prompts=tuple(args.prompts), max_tokens=args.max_tokens,
                         threads=args.threads)
    torch.set_num_threads(config.resolved_threads())
    target = load_target(config)
    variants = [(v.name, resolve(v, target, {})) for v in parse_specs(args.drafters)]
    prompts = load_prompts(config.prompts, config.prompts_per_set)
    encoded = encode_prompts(prompts, target, config.max_tokens)
    recordings: dict[tuple[Any, ...], list[Recording]] = {}
    results = {}
    for name, spec in variants:
        key = pool_key(spec)
        if key not in recordings:
            with tqdm(total=len(encoded) * (config.max_tokens - 1), desc=f"recording pools ({name})") as bar:
                recordings[key] = record(target.model, spec, encoded, config.max_tokens, spec.max_draft_len + 1,
                                         bar.update)
        steps = replay(recordings[key], load_drafter(spec, target.model), spec.max_draft_len + 1)
        record_spec = spec.to_dict()
        record_spec["path"] = shown_path(record_spec["path"])
        results[name] = {"spec": record_spec, "tau": tau(steps),
                         "per_prompt": {pr.key: tau([s]) for pr, s in zip(prompts, steps)}}
        print(f"{name}: tau {results[name]['tau']:.3f}", flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
