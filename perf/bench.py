"""`python -m perf bench`: plain decoding, transformers' generate and speculative decoding, side by side.

One run loads the target ONCE and measures, on the same prompt ids with the same max_tokens (EOS ignored, so
every run generates exactly max_tokens tokens):
    plain        our runtime with the plain drafter (root-only trees: autoregressive decoding through the same loop)
    hf           transformers' `generate` (greedy) on the same weights             (perf/hf_baseline.py)
    hf-lookup    transformers' prompt lookup decoding (`--hf-lookup N`)          (same class, other options)
    hf-assisted  transformers' assisted generation with a draft model (`--hf-assistant DIR`)
    llama.cpp plain / lookup PREC   llama.cpp's greedy decoding and its prompt lookup on the same weights at each
                 precision asked for (`--llama-cpp f32,bf16`; perf/llama_cpp.py), run as processes on the same prompts
    <spec>       speculative decoding with each drafter / tree asked for   (`--drafters`, grammar in VariantSpec)
Prompts: text is encoded by the tokenizer (BOS as configured); `chat: true` prompts are one user message rendered
through the tokenizer's chat template (no BOS added: the template places it). Every variant gets the same ids.

Greedy identity, one rule: every variant of OUR runtime must equal plain's output token for token (the project's
losslessness promise); the report says where it does not and the command then exits 1. The transformers variants
(drafter "transformers") are another implementation, whose bfloat16 / float16 arithmetic may legitimately pick the
other token at a near-tie: whether each matched plain, and where it first differed, is recorded, not enforced. The
llama.cpp variants likewise (other kernels; its --ignore-eos bans end tokens), compared on text: llama.cpp prints
text, not ids.

Timing: torch's intra-op threads are set once (`threads`) and recorded; each variant first runs `warmup`
untimed generations; the variants then take turns on each prompt (the order rotates from prompt to prompt, so a
slow drift of the machine does not favour one of them); a (variant, prompt) time is the median of `repeats`
runs, wall clock around the call that turns prompt ids into output ids. tokens/s = generated tokens / time;
speedups are ratios of tokens/s over all prompts (equal token counts, so also ratios of total time).
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from perf import stats
from perf.llama_cpp import DTYPE_PRECISION, ENGINE, LlamaCppConfig
from perf.machine import machine_info, report_header, settings_dict, torch_threads, usable_cores
from perf.prompt_sets import Prompt, load_prompts
from runtime import schema
from runtime.config import DTYPE_CHOICES, TARGET_QUANTIZATIONS
from runtime.draft_spec import DYNAMIC, GRAMMAR, PLAIN, DraftSpec, drafter_kind, kinds
from runtime.errors import ConfigError, SpectreeError
from runtime.files import shown_path
from runtime.schema import setting

KIND_ALIASES = {"plain": PLAIN}  # spec kinds that name a DraftSpec kind another way
TRANSFORMERS = "transformers"  # the drafter of every transformers variant (identity recorded, not enforced)
# the transformers variants' names (perf.hf_baseline.HFBaseline.name) and the flags that ask for them
HF_FLAGS = {"hf": "measured in every run unless --no-hf", "hf-lookup": "measured with --hf-lookup N",
            "hf-assisted": "measured with --hf-assistant DIR"}
HF_VARIANTS = tuple(HF_FLAGS)
BASELINES = ("plain", *HF_VARIANTS)  # reserved variant names (and every name starting with "llama.cpp")
TARGET_PREFIX = "spectree@llama.cpp"  # our decoding with llama.cpp as the target: its variants' names start so
OTHER_ENGINES = (TRANSFORMERS, ENGINE)  # drafters of the variants whose identity is recorded, not enforced
_LABEL = re.compile(r"[A-Za-z0-9_.-]+")
REPORT_FORMAT = "spectree-bench"
REPORT_VERSION = 2  # 2: transformers variants (identity recorded, not enforced), chat prompts, best_hf


class BenchConfigError(ConfigError):
    """A benchmark setting is invalid (the message names the setting, the value and what was expected)."""


# ---- drafter specs ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VariantSpec:
    """One speculative variant, written [NAME=]DRAFT:

        NAME   optional label for reports (default: DRAFT as written), e.g. "medusa-tuned=medusa:[[0],...]"
        DRAFT  a drafter in DraftSpec's grammar, KIND[:TREE][+KEY=VALUE...] (runtime.draft_spec.DraftSpec.parse);
               "plain" is kind PLAIN (plain decoding, already a baseline). What it leaves unset comes from the
               configured drafter (`resolve`): the tree (its options and pruning) when KIND is the configured
               drafter's and neither a tree nor options are given; the head's quantization whenever KIND is the
               configured drafter's (a tree compared with the configured one runs the same head); the weights from
               --draft-model or the configured drafter's, max_draft_len (most draft nodes per step, which cuts a
               static tree to a prefix of its canonical order) from the config's / engine's limit.
    e.g. "medusa:mc_sim_7b_63", "medusa:chain-3", "eagle", "eagle:dynamic+total_tokens=30", "lookup+max_ngram=4".
    """

    draft: DraftSpec
    text: str = ""  # as written, label excluded; "" for the configured drafter
    label: str | None = None  # NAME= prefix

    def __post_init__(self) -> None:
        if self.label is not None and (not _LABEL.fullmatch(self.label) or self.label in BASELINES
                                       or self.label.startswith(ENGINE)):
            raise BenchConfigError(f"drafter spec label {self.label!r}: expected letters, digits, '_', '-' or '.', "
                                   f"and not a baseline's name ({', '.join(BASELINES)}, {ENGINE}...)")
        mdl = self.draft.max_draft_len
        if mdl is not None and mdl < 1:
            raise BenchConfigError(f"drafter spec {self.text!r}: max_draft_len: got {mdl!r}, expected an integer >= 1 "
                                   "(a speculative variant drafts)")

    @classmethod
    def parse(cls, text: str) -> VariantSpec:
        raw = text.strip()
        if not raw:
            raise BenchConfigError(f"drafter spec: got an empty string, expected [NAME=]{GRAMMAR}")
        label = None
        named = re.match(r"([^=:+\[]+)=", raw)  # NAME= before the kind (option keys come after a '+')
        if named:
            label, raw = named.group(1).strip(), raw[named.end():].strip()
        kind = re.match(r"[^:+]*", raw).group(0).strip()
        if kind in HF_FLAGS:
            raise BenchConfigError(f"drafter spec {raw!r}: {kind} is a transformers baseline ({HF_FLAGS[kind]}); "
                                   "list only our speculative drafters")
        body = KIND_ALIASES[kind] + raw[raw.index(kind) + len(kind):] if kind in KIND_ALIASES else raw
        try:
            draft = DraftSpec.parse(body)
        except ConfigError as exc:
            raise BenchConfigError(f"drafter spec {raw!r}: {exc}") from exc
        return cls(draft, text=raw, label=label)

    @property
    def name(self) -> str:
        return self.label or self.text or f"{self.draft.kind} (configured)"

    @property
    def configured(self) -> bool:
        """Only the kind is given: the configured drafter, tree and options when the kind is the configured one."""
        return self.draft == DraftSpec(self.draft.kind)


def split_specs(text: str) -> list[str]:
    """Split a comma-separated spec list; commas inside [...] (JSON choice paths) do not separate."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise BenchConfigError(f"--drafters {text!r}: unbalanced ']' at character {i}")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise BenchConfigError(f"--drafters {text!r}: unbalanced '['")
    items.append(text[start:])
    return [s for s in (item.strip() for item in items) if s]


def parse_specs(text: str) -> tuple[VariantSpec, ...]:
    specs = tuple(VariantSpec.parse(s) for s in split_specs(text))
    names = [s.name for s in specs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise BenchConfigError(f"--drafters: {dupes} listed more than once")
    if any(s.draft.plain for s in specs):
        raise BenchConfigError(f"--drafters: plain ({PLAIN}) is a baseline, measured in every run; list only "
                               "speculative drafters")
    return specs


# ---- configuration -----------------------------------------------------------------------------------------


def check_one_target(config: Any, engine: Any) -> None:
    """The target of a perf run comes from exactly one of a builder YAML and an engine directory."""
    if (config is None) == (engine is None):
        raise BenchConfigError("give exactly one of --config (a builder YAML) or --engine (an engine directory), "
                               f"got config={config!r}, engine={engine!r}")


@dataclass(frozen=True)
class BenchConfig:
    """Everything `python -m perf bench` takes (its flags' defaults come from here)."""

    config: Path | None = None  # builder YAML (python -m builder); exactly one of config / engine
    engine: Path | None = None  # engine directory (python -m builder build)
    drafters: tuple[VariantSpec, ...] = ()  # empty: the configured drafter (unless it is plain decoding)
    draft_models: tuple[tuple[str, Path], ...] = ()  # (a weighted kind, head directory) beyond the configured one
    prompts: tuple[Path, ...] = ()  # prompt files (JSON Lines); empty: perf/prompts/{code,prose}.jsonl
    prompts_per_set: int | None = setting(None, ge=1)  # at most this many prompts from each file
    max_tokens: int = setting(64, ge=1)  # tokens generated per prompt, exactly (EOS ignored)
    warmup: int = setting(1, ge=0)  # untimed generations per variant before measuring
    repeats: int = setting(1, ge=1)  # timed generations per (variant, prompt); the median counts
    threads: int | None = setting(None, ge=1)  # torch intra-op threads; None: every usable core
    # None: the config's / engine's
    dtype: str | None = setting(None, choices=DTYPE_CHOICES)
    # "q8" / "q4": our target runs on block-quantised weights (runtime TargetModel.quantize_weights), compared with
    # llama.cpp at Q8_0 / Q4_1; None: the dtype's own weights
    target_quantization: str | None = setting(None, choices=TARGET_QUANTIZATIONS)
    hf: bool = True  # measure the transformers baseline (greedy generate)
    hf_lookup: int | None = setting(None, ge=1)  # transformers' prompt lookup decoding with this many tokens; None: not
    hf_assistant: Path | None = None  # measure transformers' assisted generation with this draft checkpoint
    llama_cpp: LlamaCppConfig = dataclasses.field(default_factory=LlamaCppConfig)  # llama.cpp as a peer: off
    # output directory; {date} and {machine} are filled in
    out: str = setting("out/perf/{date}-{machine}", nonempty=True, what="an output directory")

    def __post_init__(self) -> None:
        check_one_target(self.config, self.engine)
        schema.check(self, BenchConfigError)
        given = [k for k, _ in self.draft_models]
        heads = [k.name for k in kinds() if k.weighted]
        for kind in given:
            if kind not in heads:
                raise BenchConfigError(f"draft_models: got kind {kind!r}, expected {' or '.join(heads)} (KIND=DIR)")
        if len(set(given)) != len(given):
            raise BenchConfigError(f"draft_models: a kind is given twice ({given})")

    def resolved_threads(self) -> int:
        return self.threads if self.threads is not None else usable_cores()

    def to_dict(self) -> dict[str, Any]:
        d = settings_dict(self)
        d["drafters"] = [s.name for s in self.drafters]
        d["draft_models"] = {k: str(v) for k, v in self.draft_models}
        d["llama_cpp"] = settings_dict(self.llama_cpp)
        return d


# ---- the target and its variants ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """The loaded target, shared by every variant (weights are read-only during decoding)."""

    kind: str  # "checkpoint" | "engine"
    path: Path
    model: Any  # runtime.model.TargetModel
    tokenizer: Any  # runtime.tokenizer.Tokenizer
    # The drafter the config / engine was made for (weights path absolute; max_draft_len: its limit of draft nodes
    # per step): the defaults of specs of the same kind.
    drafter: DraftSpec
    engine: Any = None  # runtime.engine.Engine for engine directories

    def describe(self) -> dict[str, Any]:
        c = self.model.config
        return {
            "kind": self.kind,
            "path": shown_path(self.path),
            "architecture": c.architecture,
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "dtype": c.dtype,
            "weight_format": self.model.weight_format or c.dtype,
            "num_hidden_layers": c.num_hidden_layers,
            "hidden_size": c.hidden_size,
            "vocab_size": c.vocab_size,
            "configured_drafter": self.drafter.kind,
            "max_draft_len": self.drafter.max_draft_len,
        }


def load_target(config: BenchConfig) -> Target:
    """Read the builder config or open the engine, and load the target model and tokenizer once."""
    if config.config is not None:
        from builder.config import load_config
        from runtime.model import TargetModel
        from runtime.tokenizer import Tokenizer

        build = load_config(config.config)
        drafter = build.draft.spec(max_draft_len=build.build.max_draft_len)
        path = build.model.checkpoint
        model = TargetModel.from_pretrained(path, dtype=config.dtype or build.build.dtype)
        if not (path / "tokenizer.json").is_file():
            raise BenchConfigError(f"{config.config}: model.checkpoint {path} has no tokenizer.json; the benchmark "
                                   "encodes text prompts")
        if config.target_quantization is not None:
            model.quantize_weights(config.target_quantization)
        return Target("checkpoint", path, model, Tokenizer.from_dir(path), drafter)

    from runtime.engine import open_engine

    engine = open_engine(config.engine)
    drafter = engine.own_draft()  # every head file checked against engine.json before it is read
    model = engine.load_target(dtype=config.dtype)
    if config.target_quantization is not None:
        model.quantize_weights(config.target_quantization)
    tokenizer = engine.tokenizer()
    if tokenizer is None:
        raise BenchConfigError(f"engine {engine.root} has no tokenizer.json; the benchmark encodes text prompts")
    return Target("engine", Path(engine.root), model, tokenizer, drafter, engine)


def resolve(spec: VariantSpec, target: Target, draft_models: Mapping[str, Path]) -> DraftSpec:
    """The variant's drafter with what it leaves unset filled in (see VariantSpec): loadable, max_draft_len set."""
    draft, conf = spec.draft, target.drafter
    same = conf.kind == draft.kind
    limit = conf.max_draft_len
    max_draft_len = draft.max_draft_len if draft.max_draft_len is not None else limit
    if max_draft_len > limit:
        raise BenchConfigError(f"drafter spec {spec.name!r}: max_draft_len {max_draft_len} is above the "
                               f"{target.kind}'s limit of {limit} draft nodes per step")
    path = None
    if drafter_kind(draft.kind).weighted:
        path = draft_models.get(draft.kind) or (conf.path if same else None)
        if path is None:
            raise BenchConfigError(
                f"drafter spec {spec.name!r} needs {draft.kind} head weights: pass --draft-model {draft.kind}=DIR "
                f"(the {target.kind} was configured for drafter {conf.kind!r})")
    if same and draft.quantization is None:
        draft = dataclasses.replace(draft, quantization=conf.quantization)
    if same and draft.dynamic is None and draft.lookup is None:  # no options given: the configured ones
        if draft.tree is None:
            draft = dataclasses.replace(draft, tree=conf.tree, dynamic=conf.dynamic, lookup=conf.lookup,
                                        pruning=draft.pruning or conf.pruning)
        elif draft.tree == DYNAMIC and conf.static_tree is None:
            draft = dataclasses.replace(draft, dynamic=conf.dynamic)
    return dataclasses.replace(draft, path=path, max_draft_len=max_draft_len)


def describe_drafter(drafter: Any) -> dict[str, Any]:
    """The tree a drafter drafts, for the report: static (nodes, depth) or how it is built per step."""
    spec = drafter.spec
    shape = {"tree_nodes": spec.draft_nodes + 1, "tree_depth": spec.max_tree_depth}
    # prompt lookup merged into a model drafter's trees: its options beside the model drafter's tree
    merged = {"merged_lookup": dataclasses.asdict(spec.lookup)} if spec.merges_lookup else {}
    # pruned by path probability: each step verifies part of the tree
    merged |= {"pruning": dataclasses.asdict(spec.pruning)} if spec.pruning is not None else {}
    if spec.static_tree is not None:
        return {"tree": "static", **shape, "choices": [list(c) for c in spec.static_tree.choices], **merged}
    if spec.tree == DYNAMIC:
        return {"tree": "dynamic", **shape, "options": dataclasses.asdict(spec.dynamic), **merged}
    if spec.lookup is not None:
        return {"tree": "lookup", **shape, "options": dataclasses.asdict(spec.lookup)}
    return {"tree": "root-only", **shape}


def build_decoder(target: Target, spec: DraftSpec | None, name: str | None = None) -> tuple[Any, dict[str, Any]]:
    """A SpecDecoder on the shared target for a resolved spec (None: plain decoding) and a description of
    its tree; `name` (the variant's) is in its errors."""
    from runtime.decode import SpecDecoder
    from runtime.drafters import load_drafter

    if spec is None:
        drafter = load_drafter(DraftSpec(), target.model)
        return SpecDecoder(target.model, target.tokenizer, drafter, max_tree_nodes=1), describe_drafter(drafter)
    try:
        drafter = load_drafter(spec, target.model)
    except SpectreeError as exc:
        raise BenchConfigError(f"drafter spec {name or spec.describe()!r}: {exc}") from exc
    info = describe_drafter(drafter)
    info["tree_nodes"] = min(info["tree_nodes"], spec.max_draft_len + 1)
    info["max_draft_len"] = spec.max_draft_len
    return SpecDecoder.for_spec(target.model, target.tokenizer, drafter, spec), info


# ---- measurements ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One timed generation."""

    variant: str
    prompt: str  # Prompt.key
    repeat: int
    prompt_tokens: int
    token_ids: tuple[int, ...]
    wall_s: float
    target_forwards: int
    steps: int | None = None  # runtime variants only
    drafted_tokens: int | None = None
    accepted_per_step: tuple[int, ...] = ()
    time_prefill: float | None = None
    time_draft: float | None = None
    time_verify: float | None = None
    time_other: float | None = None
    # another engine that prints text, not ids (llama.cpp): token_ids is empty, these say what it generated
    generated: int | None = None  # tokens generated
    output_text: str | None = None  # the generated text, special tokens as text (compared with plain's on text)
    engine_figures: dict[str, Any] | None = None  # what that engine reported (perf.llama_cpp.LlamaOutput.figures)

    @property
    def n_generated(self) -> int:
        return len(self.token_ids) if self.generated is None else self.generated

    def to_dict(self, with_ids: bool = False) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["accepted_per_step"] = list(self.accepted_per_step)
        d["generated_tokens"] = self.n_generated
        del d["generated"]
        if with_ids:
            d["token_ids"] = list(self.token_ids)
        else:
            del d["token_ids"], d["output_text"]
        if self.engine_figures is None:
            del d["engine_figures"]
        return d


@dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # "baseline" | "speculative"
    drafter: str  # none | lookup | medusa | eagle | transformers
    info: dict[str, Any]  # tree description, load settings
    generate: Callable[[list[int], int], Run]  # (prompt ids, max_tokens) -> Run (variant/prompt/repeat unset)
    reference: str = "plain"  # the variant whose greedy output this one's is compared with


def runtime_variant(name: str, kind: str, decoder: Any, info: dict[str, Any]) -> Variant:
    def generate(ids: list[int], max_tokens: int) -> Run:
        t0 = time.perf_counter()
        result = decoder.generate(ids, max_tokens=max_tokens, ignore_eos=True)
        wall = time.perf_counter() - t0
        s = result.stats
        return Run(variant=name, prompt="", repeat=0, prompt_tokens=len(ids), token_ids=tuple(result.token_ids),
                   wall_s=wall, target_forwards=s.target_forwards, steps=s.steps, drafted_tokens=s.drafted_tokens,
                   accepted_per_step=tuple(s.accepted_per_step), time_prefill=s.time_prefill,
                   time_draft=s.time_draft, time_verify=s.time_verify, time_other=s.time_other)

    return Variant(name, kind, decoder.drafter.name, info, generate)


def hf_variant(baseline: Any) -> Variant:
    """A transformers variant (perf.hf_baseline.HFBaseline): "baseline" when greedy, "speculative" otherwise."""

    def generate(ids: list[int], max_tokens: int) -> Run:
        r = baseline.generate(ids, max_tokens)
        return Run(variant=baseline.name, prompt="", repeat=0, prompt_tokens=len(ids), token_ids=r.token_ids,
                   wall_s=r.wall_s, target_forwards=r.target_forwards)

    info = baseline.describe()
    kind = "baseline" if info["method"] == "greedy" else "speculative"
    return Variant(baseline.name, kind, TRANSFORMERS, info, generate)


def identity_enforced(variant: Variant) -> bool:
    """The one identity rule: our runtime's variants must match plain; transformers' and llama.cpp's are only
    recorded."""
    return variant.drafter not in OTHER_ENGINES


def llama_cpp_variant(runner: Any, tokenizer: Any) -> Variant:
    """A llama.cpp variant (perf.llama_cpp.LlamaCppRunner): the prompt ids decoded to text (special tokens as text,
    so llama.cpp tokenizes them back to the same ids: checked per run where it lists them), one process per run."""

    def generate(ids: list[int], max_tokens: int) -> Run:
        out, process_s = runner.generate(tokenizer.decode(ids, skip_special_tokens=False), max_tokens)
        figures = {**out.figures(), "process_s": process_s, "our_prompt_tokens": len(ids),
                   "prompt_ids_match": None if out.prompt_ids is None else list(out.prompt_ids) == list(ids)}
        return Run(variant=runner.name, prompt="", repeat=0, prompt_tokens=out.prompt_tokens, token_ids=(),
                   wall_s=out.wall_s, target_forwards=out.target_forwards, time_prefill=out.prefill_s,
                   generated=out.generated, output_text=out.text, engine_figures=figures)

    info = runner.describe()
    info |= {"tree": "chain", "tree_nodes": runner.draft_max + 1} if runner.mode == "lookup" else {"tree": "none"}
    return Variant(runner.name, "baseline" if runner.mode == "plain" else "speculative", ENGINE, info, generate)


def llama_cpp_target_variants(executor: Any, precision: str, target: Target, specs: Sequence[VariantSpec],
                              models: Mapping[str, str]) -> list[Variant]:
    """Our decoding with llama.cpp as the target (runtime/llama_cpp_decode.py over `executor`, a
    plugins.llama_cpp.LlamaCppExecutor on the GGUF at `precision`): plain, then one variant per drafter spec; each
    speculative one must equal this plain decoding (its `reference`): the same engine, so no rounding excuse."""
    from runtime.llama_cpp_decode import plain_greedy, speculative_greedy

    plain_name = f"{TARGET_PREFIX} plain {precision}"

    def run_of(result: Any, ids: list[int], wall: float) -> Run:
        s = result.stats
        return Run(variant="", prompt="", repeat=0, prompt_tokens=len(ids), token_ids=result.token_ids, wall_s=wall,
                   target_forwards=s.decodes + 1, steps=s.decodes, drafted_tokens=s.drafted,
                   accepted_per_step=tuple(e - 1 for e in s.emitted_per_decode), time_prefill=s.prefill_s,
                   time_draft=s.draft_s, time_verify=s.decode_s - s.draft_s, time_other=0.0)

    def plain(ids: list[int], max_tokens: int) -> Run:
        t0 = time.perf_counter()
        result = plain_greedy(executor, ids, max_tokens)
        return run_of(result, ids, time.perf_counter() - t0)

    info = {"engine": TARGET_PREFIX, "precision": precision, "gguf": shown_path(executor.config.model),
            "threads": executor.config.threads}
    variants = [Variant(plain_name, "baseline", PLAIN, {**info, "tree": "none"}, plain, reference=plain_name)]
    for spec in specs:
        resolved = resolve(spec, target, models)
        decoder, tree_info = build_decoder(target, resolved, spec.name)
        max_nodes = min(tree_info["tree_nodes"], executor.config.n_seq - 1)

        def speculative(ids: list[int], max_tokens: int, drafter: Any = decoder.drafter, nodes: int = max_nodes
                        ) -> Run:
            t0 = time.perf_counter()
            result = speculative_greedy(executor, drafter, ids, max_tokens, nodes, target.model.dtype)
            return run_of(result, ids, time.perf_counter() - t0)

        variants.append(Variant(f"{TARGET_PREFIX} {spec.name} {precision}", "speculative", decoder.drafter.name,
                                {**info, **tree_info, "tree_nodes": max_nodes}, speculative, reference=plain_name))
    return variants


@dataclass(frozen=True)
class LlamaCppPeer:
    """The llama.cpp variants of a run and what they ran on (perf.llama_cpp.prepare)."""

    variants: tuple[Variant, ...]
    info: dict[str, Any]  # for the report: binaries, source GGUF, files per precision, the reference variant
    reference: str | None  # "llama.cpp plain PREC" at our target's dtype, if that precision was asked for


def llama_cpp_peer(config: BenchConfig, target: Target) -> LlamaCppPeer | None:
    """llama.cpp plain and lookup per precision asked for (None when none was); the weights are checked to be the
    target's first, and the requantised files made or reused."""
    lc = config.llama_cpp
    if not lc.enabled:
        return None
    from perf import llama_cpp

    binaries, source, models = llama_cpp.prepare(lc, target.model,
                                                 lambda text: sys.stderr.write(f"llama.cpp: {text}\n"))
    runners = llama_cpp.runners(lc, binaries, models, config.resolved_threads(), target.model.config.max_context)
    own = DTYPE_PRECISION.get(target.model.weight_format or target.model.config.dtype)
    reference = next((r.name for r in runners if r.mode == "plain" and r.precision == own), None)
    info = {**binaries.describe(), "source_gguf": shown_path(source),
            "weights_checked": {"gguf": llama_cpp.CHECKED_TENSOR[0], "target": llama_cpp.CHECKED_TENSOR[1]},
            "models": {llama_cpp.PRECISIONS[p]: shown_path(m) for p, m in models.items()},
            "target_precision": llama_cpp.PRECISIONS[own] if own else None, "reference": reference,
            "openmp_environment": llama_cpp.openmp_environment()}
    variants = [llama_cpp_variant(r, target.tokenizer) for r in runners]
    if lc.target:
        from plugins.llama_cpp import ExecutorConfig, LlamaCppExecutor, available

        why = available()
        if why is not None:
            raise BenchConfigError(f"llama_cpp target: {why}")
        # prompt lookup (what llama.cpp's own lookup does, on our trees), then the drafters measured on our target
        specs = config.drafters or (VariantSpec(DraftSpec(target.drafter.kind)),)
        if not any(s.name == "lookup" for s in specs):
            specs = (VariantSpec.parse("lookup"), *specs)
        weighted = any(drafter_kind(s.draft.kind).weighted for s in specs)
        for p in lc.precisions:
            executor = LlamaCppExecutor(ExecutorConfig(
                model=str(models[p]), n_ctx=target.model.config.max_context, threads=config.resolved_threads(),
                hidden=weighted))
            variants += llama_cpp_target_variants(executor, llama_cpp.PRECISIONS[p], target, specs,
                                                  dict(config.draft_models))
    return LlamaCppPeer(tuple(variants), info, reference)


def hf_variants(config: BenchConfig, target: Target) -> list[Variant]:
    """hf, hf-lookup and hf-assisted as asked for; one transformers model of the target is shared by all."""
    if not (config.hf or config.hf_lookup is not None or config.hf_assistant is not None):
        return []
    from perf.hf_baseline import HFBaseline, load_assistant

    dtype = target.model.config.torch_dtype
    base = (HFBaseline.from_engine(target.engine, dtype) if target.kind == "engine"
            else HFBaseline.from_checkpoint(target.path, dtype))
    baselines = [base] if config.hf else []
    if config.hf_lookup is not None:
        baselines.append(base.with_prompt_lookup(config.hf_lookup))
    if config.hf_assistant is not None:
        assistant = load_assistant(config.hf_assistant, dtype)
        vocab, expected = assistant.config.get_text_config().vocab_size, target.model.config.vocab_size
        if vocab != expected:
            raise BenchConfigError(f"hf_assistant {config.hf_assistant}: vocab_size {vocab}, expected the target's "
                                   f"{expected} (assisted generation needs a draft model sharing the target's "
                                   "tokenizer)")
        baselines.append(base.with_assistant(assistant))
    return [hf_variant(b) for b in baselines]


def make_variants(config: BenchConfig, target: Target, peer: LlamaCppPeer | None = None) -> list[Variant]:
    """plain, the transformers variants asked for, llama.cpp's (`peer`), then one variant per drafter spec
    (default: the configured drafter)."""
    variants = [runtime_variant("plain", "baseline", build_decoder(target, None)[0], {"tree": "root-only"})]
    variants += hf_variants(config, target)
    variants += peer.variants if peer is not None else []
    specs = config.drafters
    if not specs:
        if target.drafter.plain:
            raise BenchConfigError(f"the {target.kind}'s drafter is {PLAIN!r}, so there is nothing speculative to "
                                   "measure; pass --drafters (e.g. lookup,medusa:chain-3)")
        specs = (VariantSpec(DraftSpec(target.drafter.kind)),)
    models = dict(config.draft_models)
    for spec in specs:
        resolved = resolve(spec, target, models)
        decoder, info = build_decoder(target, resolved, spec.name)
        info["path"] = None if resolved.path is None else shown_path(resolved.path)
        # the config's / engine's own drafter, tree and options: what the "demo configuration" means
        info["configured"] = spec.draft.kind == target.drafter.kind and spec.configured
        variants.append(runtime_variant(spec.name, "speculative", decoder, info))
    return variants


ProgressFn = Callable[[str], None]


def encode_prompt(tokenizer: Any, prompt: Prompt) -> list[int]:
    """A prompt's ids: text through the tokenizer, a chat prompt through its chat template (no BOS added)."""
    value = prompt.as_input()
    try:
        return tokenizer.encode(value) if isinstance(value, str) else tokenizer.apply_chat_template(value)
    except SpectreeError as exc:
        raise BenchConfigError(f"prompt {prompt.key} (chat: {str(prompt.chat).lower()}): {exc}") from exc


def encode_prompts(prompts: Sequence[Prompt], target: Target, max_tokens: int,
                   error: type[BenchConfigError] = BenchConfigError) -> list[list[int]]:
    """Each prompt's ids; `error` when a prompt plus max_tokens would not fit the target's context."""
    encoded = [encode_prompt(target.tokenizer, p) for p in prompts]
    context = target.model.config.max_context
    too_long = [p.key for p, ids in zip(prompts, encoded) if len(ids) + max_tokens > context]
    if too_long:
        raise error(f"prompts {too_long[:3]} plus max_tokens {max_tokens} exceed the model's context of {context} "
                    "tokens")
    return encoded


def measure(variants: Sequence[Variant], prompts: Sequence[Prompt], encoded: Sequence[list[int]],
            config: BenchConfig, progress: ProgressFn | None = None) -> list[Run]:
    """Warm up every variant, then time every (variant, prompt, repeat) on the prompts' ids (`encoded`, in the
    order of `prompts`); the variant order rotates per prompt."""
    for v in variants:
        for _ in range(config.warmup):
            v.generate(encoded[0], config.max_tokens)
            if progress:
                progress(f"warm-up {v.name}")
    runs: list[Run] = []
    n = len(variants)
    for i, (prompt, ids) in enumerate(zip(prompts, encoded)):
        order = [variants[(i + j) % n] for j in range(n)]
        for repeat in range(config.repeats):
            for v in order:
                run = v.generate(ids, config.max_tokens)
                runs.append(dataclasses.replace(run, variant=v.name, prompt=prompt.key, repeat=repeat))
                if progress:
                    progress(f"{v.name} on {prompt.key}")
    return runs


# ---- summaries ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mismatch:
    variant: str
    prompt: str
    repeat: int
    index: int  # first differing position of the generated ids
    expected: tuple[int, ...]  # plain's ids around it
    got: tuple[int, ...]


def check_identity(runs: Sequence[Run], reference: str | Mapping[str, str] = "plain",
                   decode: Callable[[Sequence[int]], str] | None = None) -> list[Mismatch]:
    """Every run's ids must equal its reference variant's (first repeat) on the same prompt: `reference` names it
    for every variant, or maps variant names to theirs (absent: "plain"). A run with text only (another engine's
    `output_text`) is compared on text: `decode` (ids -> text, special tokens as text) is then needed, and its
    Mismatch has no ids (`got` empty)."""
    from perf.llama_cpp import first_text_difference

    def reference_of(variant: str) -> str:
        return reference if isinstance(reference, str) else reference.get(variant, "plain")

    refs: dict[str, dict[str, tuple[int, ...]]] = {}
    for r in runs:
        if r.repeat == 0:
            refs.setdefault(r.variant, {})[r.prompt] = r.token_ids
    out = []
    for r in runs:
        name = reference_of(r.variant)
        ref = refs.get(name, {})
        if r.prompt not in ref:
            raise ValueError(f"no {name!r} run for prompt {r.prompt!r} to compare {r.variant!r} with")
        if r.output_text is not None:
            if decode is None:
                raise ValueError(f"{r.variant!r} printed text only: check_identity needs decode to compare it")
            i = first_text_difference(ref[r.prompt], r.output_text, decode)
            if i is not None:
                out.append(Mismatch(r.variant, r.prompt, r.repeat, i, ref[r.prompt][max(0, i - 2):i + 3], ()))
            continue
        i = stats.first_difference(ref[r.prompt], r.token_ids)
        if i is not None:
            out.append(Mismatch(r.variant, r.prompt, r.repeat, i, ref[r.prompt][max(0, i - 2):i + 3],
                                r.token_ids[max(0, i - 2):i + 3]))
    return out


def _per_prompt_wall(runs: Sequence[Run]) -> dict[str, float]:
    by_prompt: dict[str, list[float]] = {}
    for r in runs:
        by_prompt.setdefault(r.prompt, []).append(r.wall_s)
    return {p: stats.median(w) for p, w in by_prompt.items()}


def _tokens_per_s(runs: Sequence[Run], prompts: Sequence[str] | None = None) -> float | None:
    chosen = [r for r in runs if prompts is None or r.prompt in prompts]
    if not chosen:
        return None
    walls = _per_prompt_wall(chosen)
    tokens = {r.prompt: r.n_generated for r in chosen}
    return sum(tokens.values()) / sum(walls.values())


def _decode_tokens_per_s(runs: Sequence[Run]) -> float | None:
    """The decode phase alone: tokens after the first (the prefill emits it) over the time after the prefill, per
    prompt the median over repeats; None for variants without a prefill clock (transformers)."""
    if not runs or any(r.time_prefill is None for r in runs):
        return None
    by_prompt: dict[str, list[float]] = {}
    tokens: dict[str, int] = {}
    for r in runs:
        by_prompt.setdefault(r.prompt, []).append(r.wall_s - r.time_prefill)
        tokens[r.prompt] = r.n_generated - 1
    seconds = sum(stats.median(w) for w in by_prompt.values())
    return sum(tokens.values()) / seconds if seconds > 0 else None


# The intervals over prompts (the speedup's, tau's): a percentile bootstrap (each resample draws prompts with
# replacement; a speedup keeps both variants' runs of a drawn prompt together), seeded so that a report regenerates
# identically.
CI_LEVEL = 0.95
CI_RESAMPLES = 2000


def speedup_interval(runs: Sequence[Run], reference: Sequence[Run]) -> tuple[float, float] | None:
    """95% bootstrap interval over prompts of tokens/s(runs) / tokens/s(reference), each computed as `_tokens_per_s`
    does (tokens over the sum of per-prompt median walls) on the prompts both measured. It says how much the
    speedup rests on which prompts were drawn (what another prompt set of this size and kind would likely give), not
    how much the machine varies from run to run. None with fewer than two common prompts."""
    walls, ref_walls = _per_prompt_wall(runs), _per_prompt_wall(reference)
    keys = sorted(set(walls) & set(ref_walls))
    if len(keys) < 2:
        return None
    tokens = {r.prompt: r.n_generated for r in runs}
    ref_tokens = {r.prompt: r.n_generated for r in reference}
    cols = [(tokens[k], walls[k], ref_tokens[k], ref_walls[k]) for k in keys]

    def speedup(idx: Sequence[int]) -> float:
        t, w, rt, rw = (sum(cols[i][j] for i in idx) for j in range(4))
        return (t / w) / (rt / rw) if w > 0 and rt > 0 else math.inf

    return stats.bootstrap_interval(len(keys), speedup, CI_RESAMPLES, CI_LEVEL)


def tau_interval(runs: Sequence[Run]) -> tuple[float, float] | None:
    """95% bootstrap interval over prompts of tau (tokens emitted per verification step: accepted + 1 each), from
    each prompt's first repeat; None with fewer than two prompts that ran a verification step."""
    per_prompt = [(sum(r.accepted_per_step) + len(r.accepted_per_step), len(r.accepted_per_step))
                  for r in runs if r.repeat == 0 and r.accepted_per_step]
    if len(per_prompt) < 2:
        return None

    def tau(idx: Sequence[int]) -> float:
        return sum(per_prompt[i][0] for i in idx) / sum(per_prompt[i][1] for i in idx)

    return stats.bootstrap_interval(len(per_prompt), tau, CI_RESAMPLES, CI_LEVEL)


def best_hf_peer(variants: Sequence[Variant], tokens_per_s: Mapping[str, float | None]) -> str | None:
    """The fastest of transformers' speculative variants (hf-lookup, hf-assisted) over all prompts; None if none
    was measured."""
    peers = [v.name for v in variants
             if v.drafter == TRANSFORMERS and v.kind == "speculative" and tokens_per_s.get(v.name) is not None]
    return max(peers, key=lambda name: tokens_per_s[name]) if peers else None


def summarize(variants: Sequence[Variant], runs: Sequence[Run], prompts: Sequence[Prompt],
              mismatches: Sequence[Mismatch], llama_cpp_reference: str | None = None) -> list[dict[str, Any]]:
    """Per variant: tau, acceptance by depth, forwards per token, tokens/s (overall, per prompt set, and of the
    decode phase alone), time split, speedups against plain, hf, the best transformers speculative variant and
    llama.cpp's plain decoding at our dtype's precision (`llama_cpp_reference`, when measured), and whether its
    greedy output matched plain's everywhere (with the first difference; enforced for our runtime's variants
    only)."""
    sets: dict[str, list[str]] = {}
    for p in prompts:
        sets.setdefault(p.set, []).append(p.key)
    by_variant = {v.name: [r for r in runs if r.variant == v.name] for v in variants}
    tps = {name: _tokens_per_s(rs) for name, rs in by_variant.items()}
    tps_set = {name: {s: _tokens_per_s(rs, keys) for s, keys in sets.items()} for name, rs in by_variant.items()}
    references = {"plain": "plain", "hf": "hf", "best_hf": best_hf_peer(variants, tps)}
    if llama_cpp_reference is not None:
        references["llama_cpp"] = llama_cpp_reference
    out = []
    for v in variants:
        rs = by_variant[v.name]
        first = [r for r in rs if r.repeat == 0]
        generated = sum(r.n_generated for r in first)
        forwards = sum(r.target_forwards for r in first)
        differ = [m for m in mismatches if m.variant == v.name]
        speedup_ci = speedup_interval(rs, by_variant["plain"]) if v.name != "plain" and by_variant.get("plain") else None
        d: dict[str, Any] = {
            "name": v.name, "kind": v.kind, "drafter": v.drafter, **v.info,
            "prompts": len(first), "generated_tokens": generated,
            "time_s": sum(_per_prompt_wall(rs).values()),
            "tokens_per_s": tps[v.name],
            "decode_tokens_per_s": _decode_tokens_per_s(rs),
            "target_forwards_per_token": forwards / generated if generated else None,
            **{f"speedup_vs_{key}": stats.ratio(tps[v.name], tps.get(ref)) for key, ref in references.items()},
            "speedup_vs_plain_ci95": list(speedup_ci) if speedup_ci else None,
            # against llama.cpp's own plain and lookup decoding on the same GGUF (our llama.cpp-target variants)
            **({f"speedup_vs_llama_cpp_{mode}_same_precision":
                stats.ratio(tps[v.name], tps.get(f"{ENGINE} {mode} {v.info['precision']}")) for mode in ("plain", "lookup")}
               if v.info.get("engine") == TARGET_PREFIX else {}),
            "per_set": {s: {"tokens_per_s": tps_set[v.name][s],
                            **{f"speedup_vs_{key}": stats.ratio(tps_set[v.name][s], tps_set.get(ref, {}).get(s))
                               for key, ref in references.items()}}
                        for s in sets},
            "greedy_identical": not differ,
            "identity_enforced": identity_enforced(v),
            # the first (prompt, repeat) in measuring order whose ids differ from plain's, and where
            "first_difference": ({"prompt": differ[0].prompt, "repeat": differ[0].repeat, "index": differ[0].index}
                                 if differ else None),
            "prompts_differing": len({m.prompt for m in differ}),
        }
        if first and first[0].steps is not None:
            accepted = [k for r in first for k in r.accepted_per_step]
            tau_ci = tau_interval(first) if v.kind != "baseline" else None
            steps = sum(r.steps for r in first)
            d.update({
                "steps": steps,
                "tau": (sum(accepted) + len(accepted)) / len(accepted) if accepted else None,
                "tau_ci95": list(tau_ci) if tau_ci else None,
                "mean_accepted": stats.mean(accepted) if accepted else None,
                "mean_tree_nodes": 1 + sum(r.drafted_tokens for r in first) / steps if steps else None,
                "accepted_histogram": stats.accepted_histogram(accepted),
                "acceptance_by_depth": stats.reach_by_depth(accepted, d.get("tree_depth") or None),
                "conditional_acceptance_by_depth": stats.conditional_by_depth(accepted, d.get("tree_depth") or None),
                # seconds over all prompts, averaged over repeats
                "time_split_s": {name: sum(getattr(r, f"time_{name}") for r in rs) / (len(rs) // len(first))
                                 for name in ("prefill", "draft", "verify", "other")},
            })
            total = sum(d["time_split_s"].values())
            d["time_split"] = {k: t / total for k, t in d["time_split_s"].items()} if total else None
        if v.drafter == ENGINE:
            from perf.llama_cpp import summarize_figures

            d["llama_cpp"] = summarize_figures([r.engine_figures for r in first])
            d["tau"] = d["llama_cpp"].get("tokens_per_step")
        out.append(d)
    return out


def run_bench(config: BenchConfig, progress_factory: Callable[[int], Any] | None = None) -> dict[str, Any]:
    """Load, measure and summarise; returns the report (JSON-ready). Sets torch's threads for the duration."""
    with torch_threads(config.resolved_threads()):
        prompts = load_prompts(config.prompts or None, config.prompts_per_set)
        target = load_target(config)
        encoded = encode_prompts(prompts, target, config.max_tokens)
        peer = llama_cpp_peer(config, target)
        variants = make_variants(config, target, peer)
        total = len(variants) * (config.warmup + len(prompts) * config.repeats)
        started = time.perf_counter()
        if progress_factory is not None:
            with progress_factory(total) as advance:
                runs = measure(variants, prompts, encoded, config, advance)
        else:
            runs = measure(variants, prompts, encoded, config)
        elapsed = time.perf_counter() - started
        mismatches = check_identity(runs, {v.name: v.reference for v in variants},
                                    decode=lambda ids: target.tokenizer.decode(ids, skip_special_tokens=False))
        summaries = summarize(variants, runs, prompts, mismatches, peer.reference if peer else None)
        best_hf = best_hf_peer(variants, {v["name"]: v["tokens_per_s"] for v in summaries})
        machine = machine_info()
    plain_ids = {r.prompt: list(r.token_ids) for r in runs if r.variant == "plain" and r.repeat == 0}
    strict = {v.name for v in variants if identity_enforced(v)}
    drafter = {v.name: v.drafter for v in variants}
    enforced = [m for m in mismatches if m.variant in strict]
    recorded = [m for m in mismatches if drafter[m.variant] == TRANSFORMERS]
    llama_recorded = [m for m in mismatches if drafter[m.variant] == ENGINE]
    return {
        **report_header(REPORT_FORMAT, REPORT_VERSION, config.to_dict(), machine),
        "target": target.describe(),
        "measure_seconds": elapsed,
        "prompts": [{"key": p.key, "set": p.set, "id": p.id, "source": p.source, "chat": p.chat,
                     "prompt_tokens": len(ids), "output_ids": plain_ids[p.key]} for p, ids in zip(prompts, encoded)],
        # the exit status: our runtime's variants only (see identity_enforced)
        "greedy_identical": not enforced,
        "mismatches": [dataclasses.asdict(m) for m in enforced],
        # transformers' variants: recorded, not enforced
        "transformers_mismatches": [dataclasses.asdict(m) for m in recorded],
        "best_hf": best_hf,
        # llama.cpp as a peer (--llama-cpp): what it ran on, and its differences from plain (on text; recorded)
        **({"llama_cpp": peer.info, "llama_cpp_mismatches": [dataclasses.asdict(m) for m in llama_recorded]}
           if peer else {}),
        "variants": summaries,
        "runs": [r.to_dict() for r in runs],
    }


__all__ = [
    "BASELINES",
    "HF_VARIANTS",
    "OTHER_ENGINES",
    "TARGET_PREFIX",
    "TRANSFORMERS",
    "BenchConfig",
    "BenchConfigError",
    "Mismatch",
    "Run",
    "Target",
    "LlamaCppPeer",
    "Variant",
    "VariantSpec",
    "best_hf_peer",
    "build_decoder",
    "check_identity",
    "describe_drafter",
    "encode_prompt",
    "encode_prompts",
    "hf_variant",
    "hf_variants",
    "identity_enforced",
    "llama_cpp_peer",
    "llama_cpp_target_variants",
    "llama_cpp_variant",
    "load_target",
    "make_variants",
    "measure",
    "parse_specs",
    "resolve",
    "run_bench",
    "speedup_interval",
    "tau_interval",
    "split_specs",
    "summarize",
]
