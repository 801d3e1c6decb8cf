"""`python -m builder tune-tree --config BUILD.yaml`: pick the static draft tree that maximises tokens/s here.

1. Acceptance by depth and sibling rank, measured through the real decode loop (`runtime.SpecDecoder`, greedy) on
   calibration prompts with a *comb* tree: every node of the rank-0 chain has `width` children, `depth` levels.
   A recording drafter wraps the configured one and, from each step's draft and the tokens the verifier kept,
   counts for every accepted chain node at depth d - 1 whether its rank-r child was accepted:
       P[d][r] = hits[d][r] / trials[d]            (rows: depth 1 .. depth, columns: rank 0 .. width - 1)
   Steps the decode loop could prune (too close to max_tokens) are not counted.
2. Sequoia's DP (`builder.tree_search`) gives the best tree for every (nodes, levels) budget under P.
3. Step costs on this machine, through the same decode loop: for each depth the smallest, middle and largest DP
   tree, the references (mc_sim_7b_63, chains) and plain decoding run on a few calibration prompts; per-step
   draft / verify (target forward + acceptance) / other times are averaged over all their steps and fitted by
   least squares as a + b * depth + c * nodes. The trees take turns on each prompt and each tree's per-step costs
   are medians over its runs (a shared CPU makes any single timing noisy). The model ranks every candidate by
   predicted tokens per second = F(tree) / fitted step cost; with objective tokens_per_s its best few
   (`finalists`) and the fastest timed tree are then decoded again side by side with plain decoding, and the
   fastest *measured* one is chosen (a line in depth and nodes misses steps in the real cost curve, e.g. where
   the matmul kernels change blocking).
4. The chosen choice paths go into draft.tree.choices of a copy of the config (or the config itself with
   --in-place); the written config is validated with `plan_build` before it replaces anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from builder.config import BuildConfig, BuildConfigError, load_config
from builder.plan import plan_build
from builder.tree_search import best_tree, expected_tokens
from runtime import schema
from runtime.decode import SpecDecoder
from runtime.draft_spec import DraftSpec, PruneOptions, drafter_kind, kinds
from runtime.drafters import load_drafter
from runtime.drafters.none import NoneDrafter
from runtime.model import TargetModel
from runtime.prompts import load_prompt_file
from runtime.protocol import Draft, feature_layers_of
from runtime.schema import setting
from runtime.tokenizer import Tokenizer
from runtime.tree import Tree

OBJECTIVES = ("tokens_per_s", "tau")
TUNED_NOTE = "# tune-tree: "
DEFAULT_GRID = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)


@dataclass(frozen=True)
class TuneSettings:
    """How tune-tree measures and chooses; the CLI reads its defaults from here.

    max_tokens      tokens generated per calibration prompt
    width, depth    the measurement comb: children per chain node (ranks measured) and levels (Medusa: at most
                    its number of heads)
    max_nodes       largest tree considered, root included (also capped by build.max_draft_len + 1)
    grid            tree sizes the DP is solved for at every depth (max_nodes is always added)
    timing_prompts  calibration prompts each timed tree decodes (step costs average over all their steps)
    references      preset trees timed and reported beside the DP's (when they fit depth and max_nodes)
    objective       "tokens_per_s": the best rate with this machine's measured costs (Sequoia's hardware-aware
                    choice); "tau": the most expected tokens per step within max_nodes (for a machine where a tree
                    step costs about the same as a plain one, e.g. a GPU at batch 1), the smaller tree on ties
    require_speedup with tokens_per_s: fail when no tree is predicted to beat plain decoding here (the honest
                    answer for this machine); False writes the fastest tree anyway (a demo, or a config meant for
                    another machine), its speedup recorded in the config's note
    finalists       with tokens_per_s: the cost model's best this many trees (plus the fastest timed one) are
                    decoded again beside plain decoding, and the fastest measured is chosen
    """

    max_tokens: int = setting(64, ge=2)
    width: int = setting(10, ge=1)
    depth: int = setting(6, ge=1)
    max_nodes: int = setting(64, ge=2)
    grid: tuple[int, ...] = DEFAULT_GRID
    timing_prompts: int = setting(3, ge=1)
    references: tuple[str, ...] = ("mc_sim_7b_63", "chain-3", "chain-5")
    objective: str = setting("tokens_per_s", choices=OBJECTIVES)
    require_speedup: bool = True
    finalists: int = setting(4, ge=1)

    def __post_init__(self) -> None:
        schema.check(self, BuildConfigError)


# ---- 1. acceptance ----------------------------------------------------------------------------------------


def comb_tree(width: int, depth: int) -> Tree:
    """Rank-0 chain of `depth` nodes, each chain node (and the root) with children of ranks 0 .. width - 1."""
    paths = [(0,) * (d - 1) + (r,) for d in range(1, depth + 1) for r in range(width)]
    return Tree.from_choices(paths)


@dataclass
class AcceptanceCounts:
    """hits[d - 1][r]: rank-r child accepted below an accepted depth-(d-1) chain node; trials[d - 1]: such nodes."""

    width: int
    depth: int
    hits: np.ndarray = field(init=False)  # [depth, width] int64
    trials: np.ndarray = field(init=False)  # [depth] int64
    steps: int = 0

    def __post_init__(self) -> None:
        self.hits = np.zeros((self.depth, self.width), dtype=np.int64)
        self.trials = np.zeros(self.depth, dtype=np.int64)

    def record(self, draft: Draft, kept: Sequence[int]) -> None:
        """kept: the tokens the step committed (root first, accepted draft tokens after it)."""
        tree, tokens = draft.tree, draft.tokens.tolist()
        depth, ranks = tree.depth.tolist(), tree.ranks.tolist()
        node = 0
        for tok in list(kept[1:]) + [None]:  # None: after the last accepted node nothing more was accepted
            kids = tree.children(node)
            if not kids:
                break
            self.trials[depth[node]] += 1
            match = next((c for c in kids if tokens[c] == tok), None)
            if match is None:
                break
            self.hits[depth[node], ranks[match]] += 1
            node = match
        self.steps += 1

    def table(self) -> np.ndarray:
        """P[d][r] # [depth, width] (rows with no trials are 0: an unreached depth earns nothing)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            p = np.where(self.trials[:, None] > 0, self.hits / np.maximum(self.trials[:, None], 1), 0.0)
        return p


class _RecordingSession:
    def __init__(self, inner, counts: AcceptanceCounts, budget: list[int]) -> None:
        self.inner, self.counts, self.budget = inner, counts, budget
        self.last: Draft | None = None

    def draft(self, root: int, params: Any = None, generator: torch.Generator | None = None,
              max_nodes: int | None = None) -> Draft:
        self.last = self.inner.draft(root, params, generator, max_nodes)
        return self.last

    def advance(self, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        # budget = [tokens emitted so far, max_tokens]: a step the loop may have pruned is not counted.
        emitted, limit = self.budget
        if self.last is not None and limit - emitted > self.counts.depth:
            self.counts.record(self.last, tokens.tolist())
        self.budget[0] += tokens.shape[0]
        self.inner.advance(tokens, hidden)


class RecordingDrafter:
    """Wraps a drafter (the Drafter protocol) and records acceptance by depth and rank of every step."""

    def __init__(self, inner, counts: AcceptanceCounts, max_tokens: int) -> None:
        self.inner, self.counts, self.max_tokens = inner, counts, max_tokens
        self.name = inner.name
        self.feature_layers = feature_layers_of(inner)  # the target layers the wrapped drafter reads

    def start(self, prompt: torch.Tensor, hidden: torch.Tensor, max_nodes: int) -> _RecordingSession:
        return _RecordingSession(self.inner.start(prompt, hidden, max_nodes), self.counts, [1, self.max_tokens])


def _drafter_with_tree(drafter, model: TargetModel, tree: Tree, pruning: PruneOptions | None = None):
    """The same loaded heads with another static tree (no re-reading of weights); pruning: for timing a tree as the
    config runs it (the acceptance comb is measured whole)."""
    return drafter_kind(drafter.name).with_tree(drafter, model, tree, pruning)


# ---- 2. costs ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepTiming:
    """One tree run through the real decode loop: per-step seconds by part, and what it achieved."""

    num_nodes: int
    depth: int
    draft_s: float  # drafting + drafter bookkeeping (advance), per step
    verify_s: float  # target forward over the tree + acceptance, per step
    other_s: float  # cache compaction, detokenisation, stop checks, per step
    tau: float  # measured tokens per step
    tokens_per_s: float  # measured, prefill included


def time_trees(model: TargetModel, tokenizer: Tokenizer, runs: Sequence[tuple[str, Any, int, int]],
               prompts: Sequence[str], max_tokens: int) -> dict[str, StepTiming]:
    """runs: (name, drafter, num_nodes, depth). Each prompt is decoded by every drafter in turn (interleaved, so a
    burst of load on a shared machine hits them all alike); a tree's per-step costs are the medians over its
    prompts' runs (one disturbed run does not move them), tau and tokens/s its totals over all of them."""
    decoders = {name: SpecDecoder(model, tokenizer, drafter, max_tree_nodes=nodes) for name, drafter, nodes, _ in runs}
    per_run: dict[str, list[tuple[float, float, float]]] = {name: [] for name in decoders}
    totals = {name: [0, 0, 0, 0.0] for name in decoders}  # steps, emitted, generated, seconds
    for prompt in prompts:
        for name, decoder in decoders.items():
            s = decoder.generate(prompt, max_tokens=max_tokens, temperature=0.0).stats
            n = max(s.steps, 1)
            per_run[name].append((s.time_draft / n, s.time_verify / n, s.time_other / n))
            t = totals[name]
            t[0], t[1], t[2], t[3] = t[0] + s.steps, t[1] + s.generated_tokens - 1, t[2] + s.generated_tokens, \
                t[3] + s.time_total
    out = {}
    for name, _, nodes, depth in runs:
        draft, verify, other = (float(np.median(col)) for col in zip(*per_run[name]))
        steps, emitted, generated, seconds = totals[name]
        out[name] = StepTiming(nodes, depth, draft, verify, other, emitted / max(steps, 1),
                               generated / max(seconds, 1e-9))
    return out


# ---- 3. choice --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    name: str
    choices: tuple[tuple[int, ...], ...]
    num_nodes: int
    depth: int
    expected: float  # F(tree) under the measured P (predicted tau)
    t_draft: float  # per step, from the fitted step-cost model
    t_target: float  # target forward + acceptance, per step
    t_other: float
    measured_tau: float | None = None  # when this tree itself was run while timing
    measured_tokens_per_s: float | None = None

    @property
    def step_s(self) -> float:
        return self.t_draft + self.t_target + self.t_other

    @property
    def tokens_per_s(self) -> float:
        return self.expected / self.step_s

    def speedup(self, plain: Candidate) -> float:
        """Over plain decoding: measured side by side when both ran together (the finalists), else predicted."""
        if self.measured_tokens_per_s is not None and plain.measured_tokens_per_s is not None:
            return self.measured_tokens_per_s / plain.measured_tokens_per_s
        return self.tokens_per_s / plain.tokens_per_s


@dataclass(frozen=True)
class TuneResult:
    method: str
    acceptance: list[list[float]]  # P[d][r]
    trials: list[int]
    calibration: dict[str, Any]  # prompts, steps, measured tau with the comb tree, cost model, timed trees
    plain: Candidate  # root only: plain decoding through the same loop
    best: Candidate
    references: list[Candidate]
    candidates: list[Candidate]

    def to_dict(self) -> dict[str, Any]:
        def cand(c: Candidate) -> dict[str, Any]:
            return {"name": c.name, "num_nodes": c.num_nodes, "depth": c.depth, "expected_tau": c.expected,
                    "t_draft_ms": 1e3 * c.t_draft, "t_target_ms": 1e3 * c.t_target, "t_other_ms": 1e3 * c.t_other,
                    "tokens_per_s": c.tokens_per_s, "speedup": c.tokens_per_s / self.plain.tokens_per_s,
                    "measured_tau": c.measured_tau, "measured_tokens_per_s": c.measured_tokens_per_s,
                    "choices": [list(p) for p in c.choices]}

        return {"method": self.method, "acceptance_by_depth_rank": self.acceptance, "trials_by_depth": self.trials,
                "calibration": self.calibration,
                "plain": cand(self.plain), "best": cand(self.best), "references": [cand(c) for c in self.references],
                "candidates": [cand(c) for c in self.candidates]}


def tune(
    config: BuildConfig, prompts: Sequence[str], settings: TuneSettings = TuneSettings(), progress=None
) -> TuneResult:
    """Measure, search and choose (see the module docstring). progress(str) receives stage messages."""
    max_tokens, width, depth, max_nodes = settings.max_tokens, settings.width, settings.depth, settings.max_nodes
    grid, references, objective = settings.grid, settings.references, settings.objective
    say = progress or (lambda msg: None)
    d = config.draft
    kind = d.spec().drafter_kind
    if not kind.weighted:
        heads = " or ".join(repr(k.name) for k in kinds() if k.weighted)
        raise BuildConfigError(f"{config.source}: draft.method: got {d.method!r}, expected {heads} "
                               "(tune-tree chooses static trees for draft heads)")
    if not prompts:
        raise BuildConfigError("no calibration prompts")
    model = TargetModel.from_pretrained(config.model.checkpoint, dtype=config.build.dtype)
    tokenizer = Tokenizer.from_dir(config.model.checkpoint)
    # The head as the config runs it (its quantization: drafting costs depend on it), without a merged prompt lookup:
    # the tree is tuned for what the head drafts.
    base = load_drafter(DraftSpec(kind.name, path=d.checkpoint, tree=Tree.chain(1), quantization=d.quantization), model)
    if (deepest := kind.max_depth(base)) is not None:
        depth = min(depth, deepest)
    max_nodes = min(max_nodes, config.build.max_draft_len + 1)

    # 1. acceptance through the real decode loop
    comb = comb_tree(width, depth)
    counts = AcceptanceCounts(width, depth)
    recorder = RecordingDrafter(_drafter_with_tree(base, model, comb), counts, max_tokens)
    decoder = SpecDecoder(model, tokenizer, recorder, max_tree_nodes=comb.num_nodes)
    steps = emitted = 0
    t_total = 0.0
    for i, prompt in enumerate(prompts):
        say(f"calibration prompt {i + 1}/{len(prompts)}")
        out = decoder.generate(prompt, max_tokens=max_tokens, temperature=0.0)
        s = out.stats
        steps += s.steps
        emitted += s.generated_tokens - 1
        t_total += s.time_total
    if counts.steps == 0:
        raise BuildConfigError(f"the calibration prompts gave no countable steps (max_tokens {max_tokens} <= depth "
                               f"{depth}?)")
    P = counts.table()  # [depth, width]

    # 2. the DP's best tree for every (nodes, levels) budget
    sizes = sorted({m for m in grid if 2 <= m <= max_nodes} | {max_nodes})
    found_trees: list[tuple[str, Tree, float]] = []
    seen: set[tuple[tuple[int, ...], ...]] = set()
    for levels in range(2, depth + 2):
        for m in sizes:
            found = best_tree(P, m, levels)
            if found.choices in seen or not found.choices:
                continue
            seen.add(found.choices)
            found_trees.append((f"dp-{found.num_nodes}x{levels - 1}", Tree.from_choices(found.choices), found.expected))
    ref_trees = []
    for name in references:
        tree = Tree.preset(name)
        if tree.max_depth <= depth and tree.num_nodes <= max_nodes:  # else deeper than measured / too large
            ref_trees.append((name, tree, expected_tokens(tree.choices, P)))

    # 3. step costs through the real decode loop for a spread of trees (each depth: smallest, middle, largest
    # candidate; the references; plain decoding), then least squares per part: cost = a + b * depth + c * nodes.
    timing_prompts = list(prompts[:settings.timing_prompts])
    by_depth: dict[int, list[tuple[str, Tree, float]]] = {}
    for c in found_trees:
        by_depth.setdefault(c[1].max_depth, []).append(c)
    timed_set = {id(c) for group in by_depth.values() for c in (group[0], group[len(group) // 2], group[-1])}
    timed = [c for c in found_trees if id(c) in timed_set] + ref_trees
    say(f"timing {len(timed)} trees and plain decoding, interleaved over {len(timing_prompts)} prompts")
    timings = time_trees(model, tokenizer, [(name, _drafter_with_tree(base, model, tree, d.pruning), tree.num_nodes,
                                             tree.max_depth) for name, tree, _ in timed]
                         + [("plain", NoneDrafter(), 1, 0)], timing_prompts, max_tokens)
    plain_t = timings.pop("plain")
    feats = np.array([[1.0, t.depth, t.num_nodes] for t in timings.values()])  # [R, 3]

    def fit(part: str) -> np.ndarray:
        return np.linalg.lstsq(feats, np.array([getattr(t, part) for t in timings.values()]), rcond=None)[0]

    coef = {part: fit(part) for part in ("draft_s", "verify_s", "other_s")}

    def candidate(name: str, tree: Tree, expected: float) -> Candidate:
        x = np.array([1.0, tree.max_depth, tree.num_nodes])
        cost = {part: max(float(c @ x), 0.0) for part, c in coef.items()}
        t = timings.get(name)
        return Candidate(name, tree.choices, tree.num_nodes, tree.max_depth, expected, cost["draft_s"],
                         cost["verify_s"], cost["other_s"], None if t is None else t.tau,
                         None if t is None else t.tokens_per_s)

    candidates = [candidate(*c) for c in found_trees]
    refs = [candidate(*c) for c in ref_trees]
    plain = Candidate("plain", (), 1, 0, 1.0, plain_t.draft_s, plain_t.verify_s, plain_t.other_s, plain_t.tau,
                      plain_t.tokens_per_s)
    finalists: dict[str, dict[str, float]] = {}
    if objective == "tau":
        best = max(candidates, key=lambda c: (round(c.expected, 9), -c.num_nodes), default=plain)
    else:
        # The fitted model ranks every candidate; the finalists (its best few, and the timed tree that ran fastest)
        # are decoded again side by side with plain decoding, and the fastest measured one is chosen: a straight
        # line in depth and nodes cannot follow every step in a machine's cost curve, a measurement can.
        ranked = sorted(candidates, key=lambda c: c.tokens_per_s, reverse=True)
        picks = ranked[:settings.finalists]
        ran = [c for c in candidates if c.measured_tokens_per_s is not None]
        if ran:
            fastest_run = max(ran, key=lambda c: c.measured_tokens_per_s)
            picks += [fastest_run] if fastest_run not in picks else []
        say(f"timing the finalists {', '.join(c.name for c in picks)} against plain decoding")
        final = time_trees(model, tokenizer, [(c.name, _drafter_with_tree(base, model, Tree.from_choices(c.choices),
                                                                          d.pruning), c.num_nodes, c.depth)
                                              for c in picks]
                           + [("plain", NoneDrafter(), 1, 0)], timing_prompts, max_tokens)
        finalists = {name: {"tau": t.tau, "tokens_per_s": t.tokens_per_s} for name, t in final.items()}
        picks = [dataclasses.replace(c, measured_tau=final[c.name].tau,
                                     measured_tokens_per_s=final[c.name].tokens_per_s) for c in picks]
        best = max(picks, key=lambda c: c.measured_tokens_per_s, default=plain)
        plain = dataclasses.replace(plain, measured_tau=final["plain"].tau,
                                    measured_tokens_per_s=final["plain"].tokens_per_s)
        candidates = [next((p for p in picks if p.name == c.name), c) for c in candidates]
    if best.expected <= 1.0:
        raise BuildConfigError(f"the heads in {d.checkpoint} never matched the target on the calibration prompts "
                               f"(acceptance by depth {[round(float(r.sum()), 3) for r in P]}): were they trained "
                               "for it?")
    if objective == "tokens_per_s" and settings.require_speedup and best.speedup(plain) <= 1.0:
        raise BuildConfigError(
            f"no draft tree beats plain decoding on this machine: the best, {best.name} (predicted tau "
            f"{best.expected:.2f}), ran at {best.speedup(plain):.2f}x plain decoding (predicted: draft "
            f"{1e3 * best.t_draft:.2f} ms + target {1e3 * best.t_target:.2f} ms per step vs {1e3 * plain.t_target:.2f} "
            f"ms); use objective 'tau' to choose for acceptance alone, or --even-if-slower")
    calibration = {"prompts": len(prompts), "max_tokens": max_tokens, "comb_width": width, "comb_depth": depth,
                   "steps": steps, "counted_steps": counts.steps, "comb_tau": emitted / max(steps, 1),
                   "time_total_s": t_total, "timing_prompts": len(timing_prompts),
                   "step_cost_model_ms": {part: dict(zip(("intercept", "per_level", "per_node"), (1e3 * c).tolist()))
                                          for part, c in coef.items()},
                   "timed": {n: dataclasses.asdict(t) for n, t in timings.items()},
                   "finalists": finalists}
    return TuneResult(d.method, P.round(6).tolist(), counts.trials.tolist(), calibration, plain, best, refs,
                      candidates)


# ---- 4. writing the config --------------------------------------------------------------------------------


def write_choices(config_path: Path, choices: Sequence[Sequence[int]], output: Path, note: str) -> BuildConfig:
    """Copy the YAML at config_path with draft.tree = {choices: ...} to `output` (validated before it is written)."""
    import yaml

    original = config_path.read_text(encoding="utf-8")
    data = yaml.safe_load(original)
    # Keep the file's leading comment block (minus an earlier tune-tree note); YAML round-trips drop comments.
    header = []
    for line in original.splitlines():
        if not line.startswith("#"):
            break
        if not line.startswith(TUNED_NOTE):
            header.append(line)
    data.setdefault("draft", {})["tree"] = {"choices": [list(p) for p in choices]}
    # Relative paths in the copy must still resolve: rewrite them against the new file's directory.
    src_dir, dst_dir = config_path.resolve().parent, output.resolve().parent
    if src_dir != dst_dir:
        _rebase_paths(data, src_dir, dst_dir)
    text = "\n".join(header + [f"{TUNED_NOTE}{note}"]) + "\n" + yaml.safe_dump(
        data, sort_keys=False, default_flow_style=None, width=120)
    tmp = output.with_name(output.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    try:
        written = load_config(tmp)
        plan_build(written, require_output=False)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(output)
    return load_config(output)


def _rebase_paths(data: dict, src: Path, dst: Path) -> None:
    import os

    for section, key in (("model", "checkpoint"), ("draft", "checkpoint"), ("build", "output")):
        value = (data.get(section) or {}).get(key)
        if isinstance(value, str) and not Path(value).expanduser().is_absolute():
            data[section][key] = os.path.relpath((src / value).resolve(), dst)


def read_prompts(path: Path) -> list[str | list[dict[str, str]]]:
    """A prompt file (`runtime.prompts` format) as decoder inputs: raw text, or one user message for chat prompts."""
    return [p.as_input() for p in load_prompt_file(path)]


# ---- CLI --------------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="build YAML (draft.method medusa or eagle)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", help="calibration prompts, JSON lines {\"prompt\": ...}")
    src.add_argument("--heldout", metavar="TRAIN_YAML",
                     help="cut calibration prompts from the held-out split of this training config's corpus")
    p.add_argument("--save-prompts", metavar="PATH", help="write the calibration prompts used (JSON lines) here")
    p.add_argument("--output", help="write the tuned config here (default: next to --config as NAME-tuned.yaml)")
    p.add_argument("--in-place", action="store_true", help="rewrite --config itself")
    p.add_argument("--report", help="also write the measurements and candidates as JSON here")
    d = TuneSettings()
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="tokens generated per calibration prompt")
    p.add_argument("--width", type=int, default=d.width, help="children per node of the measurement comb (ranks measured)")
    p.add_argument("--depth", type=int, default=d.depth, help="depth of the measurement comb (Medusa: at most its heads)")
    p.add_argument("--max-nodes", type=int, default=d.max_nodes, help="largest tree considered, root included")
    p.add_argument("--timing-prompts", type=int, default=d.timing_prompts,
                   help="calibration prompts each timed tree decodes (step costs are averaged over all their steps)")
    p.add_argument("--threads", type=int, help="torch threads while measuring")
    p.add_argument("--objective", choices=OBJECTIVES, default=d.objective,
                   help="tokens_per_s: fastest here (default); tau: most tokens per step within --max-nodes")
    p.add_argument("--finalists", type=int, default=d.finalists,
                   help="with tokens_per_s: trees re-timed beside plain decoding before the fastest is chosen")
    p.add_argument("--even-if-slower", action="store_true", default=not d.require_speedup,
                   help="with tokens_per_s: write the fastest tree even when plain decoding is predicted faster here")


def _table(result: TuneResult):
    from rich.table import Table

    t = Table(title=f"{result.method}: predicted tokens/s on this machine", title_justify="left")
    for col in ("tree", "nodes", "depth", "tau pred", "step ms", "tok/s pred", "speedup pred", "tau run", "tok/s run"):
        t.add_column(col, justify="left" if col == "tree" else "right")
    base = result.plain.tokens_per_s
    for c in [result.plain, result.best, *result.references]:
        t.add_row(c.name if c is not result.best else f"[bold]{c.name} (chosen)[/bold]", str(c.num_nodes),
                  str(c.depth), f"{c.expected:.2f}", f"{1e3 * c.step_s:.2f}", f"{c.tokens_per_s:.1f}",
                  f"{c.tokens_per_s / base:.2f}x", "-" if c.measured_tau is None else f"{c.measured_tau:.2f}",
                  "-" if c.measured_tokens_per_s is None else f"{c.measured_tokens_per_s:.1f}")
    return t


def run_cli(args: argparse.Namespace, console) -> int:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    config_path = Path(args.config)
    config = load_config(config_path)
    if args.in_place and args.output:
        raise BuildConfigError("pass either --output or --in-place, not both")
    output = config_path if args.in_place else Path(args.output) if args.output else \
        config_path.with_name(config_path.stem + "-tuned.yaml")
    if args.prompts:
        prompts = read_prompts(Path(args.prompts))
    else:
        from builder.training.config import load_train_config
        from builder.training.corpus import held_out_prompts, split_corpus

        prompts = held_out_prompts(split_corpus(load_train_config(args.heldout).corpus), "calibration")
    if args.save_prompts:
        Path(args.save_prompts).write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts), encoding="utf-8")
    settings = TuneSettings(max_tokens=args.max_tokens, width=args.width, depth=args.depth, max_nodes=args.max_nodes,
                            timing_prompts=args.timing_prompts, objective=args.objective,
                            require_speedup=not args.even_if_slower, finalists=args.finalists)
    result = tune(config, prompts, settings, progress=lambda m: console.log(m))
    console.print(f"acceptance P[depth][rank] (rows depth 1..{len(result.acceptance)}, first 4 ranks): "
                  + "; ".join(" ".join(f"{x:.2f}" for x in row[:4]) for row in result.acceptance))
    console.print(_table(result))
    best = result.best
    note = (f"draft.tree chosen by `python -m builder tune-tree` ({result.method}, {len(prompts)} prompts): "
            f"{best.num_nodes} nodes, depth {best.depth}, predicted tau {best.expected:.2f}, "
            f"{best.speedup(result.plain):.2f}x plain decoding"
            f"{' (measured on the calibration prompts)' if result.calibration.get('finalists') else ' (predicted)'}")
    write_choices(config_path, best.choices, output, note)
    console.print(f"[green]wrote[/green] {output} ({best.name}: {len(best.choices)} choice paths)")
    if args.report:
        Path(args.report).write_text(json.dumps(result.to_dict(), indent=1) + "\n", encoding="utf-8")
        console.print(f"report: {args.report}")
    return 0


__all__ = [
    "AcceptanceCounts",
    "Candidate",
    "RecordingDrafter",
    "StepTiming",
    "TuneResult",
    "TuneSettings",
    "add_arguments",
    "comb_tree",
    "read_prompts",
    "run_cli",
    "time_trees",
    "tune",
    "write_choices",
]
