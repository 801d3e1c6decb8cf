"""Which drafter: `DraftSpec`, the one description of a drafter (kind, head weights, tree, options, max draft length);
the generic rules of what goes with which kind; and the registry of drafter kinds, each of which owns its own rules.
Every front end says "which drafter" with it:

    runtime.load / python -m runtime     LoadConfig.draft_spec()      (draft, draft_model, tree, draft options)
    the builder's YAML `draft:` section  DraftSection.spec()          (method, checkpoint, tree, lookup)
    engine.json's "draft" record         DraftSpec.from_mapping / to_dict
    python -m perf bench / batch         DraftSpec.parse("KIND[:TREE][+KEY=VALUE...]")
    the drafters                         runtime.drafters.load_drafter(spec, model); a loaded drafter's `spec`

Each front end keeps its own spelling of a field (user-facing: YAML keys, keywords and flags, engine.json keys);
`FIELD_NAMES` is the one table of them, and errors name a field as the front end spells it (`field_names`).

Fields:
    kind           a registered drafter kind (`kind_names()`)
    path           head weights directory (weighted kinds only); None: not known yet (an engine's or a config's)
    tree           a static `Tree`, DYNAMIC (EAGLE-2's dynamic tree), or None: the drafter's default
    dynamic        DynamicTreeOptions of the dynamic tree (None: the defaults); setting them makes tree DYNAMIC
    lookup         LookupOptions: drafter lookup's own (None: the defaults); on a weighted kind, prompt-lookup
                   continuations merged into each step's model-drafted tree (None: no merge)
    pruning        PruneOptions: each step's draft nodes whose path is less likely than min_path_prob under the
                   head are not verified (None: every node is)
    max_draft_len  most draft nodes per step, root excluded (TensorRT-LLM's meaning); None: the caller's limit
    quantization   the draft head's weights as drafting reads them: None (their own dtype), "int8" (weight-only,
                   per-row scales, CPU) or "int4" (weight-only, a scale and zero per 32 inputs, CPU): drafting
                   reads a few rows per call, so their bytes are its cost; only what is drafted changes, never the
                   output

A front end may leave path, tree, options and max_draft_len unset and fill them from a configured drafter (its
own policy, e.g. `LoadConfig.draft_spec`); `load_drafter` needs only the weights of weighted kinds
(`require_weights`), and the spec of a loaded drafter has every default resolved.

The generic rules (`DraftSpec.__post_init__`, `with_options`, `require_weights`), each read off the kind
(`DrafterKind`): the kind is registered; only weighted kinds have weights, and need them to load; a kind takes the
option sets it lists (`DrafterKind.options`); the dynamic tree goes with the "dynamic" option set, never with a
static tree; lookup options on a weighted kind merge prompt lookup into its trees, and a datastore needs a head
directory; quantization is one of QUANTIZATIONS its kind runs. Then the kind's own rules (`DrafterKind.check`, e.g.
lookup takes no tree). Errors are `DraftSpecError`s naming the field, so each front end names its own key for it.

Drafter kinds: one module each (`runtime/drafters/<kind>.py`) defines a `DrafterKind` subclass and its instance
`KIND`: name, weights, option sets, its rules, the tree it drafts, its loader. The registry (`drafter_kind`,
`kinds`) imports the built-in kind modules (`BUILTIN_KINDS`) by name on the first lookup; `register` adds another
kind (from its own module, which the caller imports). The builder's share of a kind (engine files, TensorRT-LLM
export, training) is registered the same way in `builder/drafters/`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from runtime import schema
from runtime.errors import ConfigError
from runtime.registry import Registry
from runtime.schema import setting
from runtime.tree import Tree

QUANTIZATIONS = ("int8", "int4")  # DraftSpec.quantization values (None: the weights' own dtype); runtime.model's
# QUANTIZED_WEIGHTS maps each to its weight class
DYNAMIC: Literal["dynamic"] = "dynamic"  # the tree of EAGLE-2: chosen every step from the head's scores
GRAMMAR = "KIND[:TREE][+KEY=VALUE...]"


class DraftSpecError(ConfigError):
    """A drafter spec breaks a rule. `field` is the DraftSpec field it concerns ("options": KEY=VALUE options not
    yet typed), `detail` the message without it: a front end restates it under its own key (`field_names`)."""

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(field, detail)  # both in args: a pickled error comes back whole
        self.field = field
        self.detail = detail

    def __str__(self) -> str:
        return f"{self.field}: {self.detail}"


@dataclass(frozen=True)
class FieldNames:
    """One DraftSpec field as each front end spells it."""

    yaml: str  # the builder YAML's key path
    load: str  # runtime.load's keyword (python -m runtime's flag: --draft-model for draft_model)
    record: str  # engine.json's "draft" record key


FRONT_ENDS = ("yaml", "load", "record")
FIELD_NAMES: dict[str, FieldNames] = {
    "kind": FieldNames("draft.method", "draft", "method"),
    "path": FieldNames("draft.checkpoint", "draft_model", "path"),
    "tree": FieldNames("draft.tree", "tree", "tree"),
    "dynamic": FieldNames("draft.tree.dynamic", "draft_options", "tree"),
    "lookup": FieldNames("draft.lookup", "draft_options", "options"),
    "pruning": FieldNames("draft.pruning", "draft_options", "options"),
    "options": FieldNames("draft", "draft_options", "options"),  # KEY=VALUE options not yet typed
    "max_draft_len": FieldNames("build.max_draft_len", "max_draft_len", "max_draft_len"),
    "quantization": FieldNames("draft.quantization", "draft_quantization", "quantization"),
}


@contextmanager
def field_names(front_end: str, error: type[ConfigError] = ConfigError, prefix: str = "") -> Iterator[None]:
    """Re-raise a DraftSpecError raised inside as `error`, its field named as `front_end` (one of FRONT_ENDS) spells
    it, after `prefix`."""
    if front_end not in FRONT_ENDS:
        raise ValueError(f"front_end must be one of {FRONT_ENDS}, got {front_end!r}")
    try:
        yield
    except DraftSpecError as exc:
        names = FIELD_NAMES.get(exc.field)
        raise error(f"{prefix}{exc.field if names is None else getattr(names, front_end)}: {exc.detail}") from exc


# ---- the drafters' options --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DynamicTreeOptions:
    """EAGLE-2 dynamic tree, with EAGLE-2's own parameter meanings (SafeAILab/EAGLE `topK_generate`).

    total_tokens  tree size, root included (EAGLE-2's total_token; the paper uses 60); with prompt lookup merged,
                  the merged tree's (the best nodes of the head's pool and lookup's continuations).
    depth         expansion rounds after the root's top_k: the tree is at most depth + 1 deep.
    top_k         children per expanded node and frontier width.
    """

    total_tokens: int = setting(60, ge=1)
    depth: int = setting(5, ge=0)
    top_k: int = setting(10, ge=1)

    def __post_init__(self) -> None:
        schema.check(self, ConfigError, "dynamic")


@dataclass(frozen=True)
class LookupOptions:
    """Bounds of one prompt-lookup draft.

    max_ngram / min_ngram   suffix lengths tried, longest first (min_ngram >= 1).
    num_draft_tokens        draft nodes per tree, root excluded (also bounded by the session's max_nodes).
    max_depth               longest continuation copied from one occurrence (None: num_draft_tokens).
    max_branches            distinct continuations merged into the tree (1: a plain chain, PLD's original form).
    datastore_tokens        nodes of one more continuation per step, from the datastore of the target's own answers
                            in the draft head's directory (runtime/drafters/datastore.py; 0: none). Medusa / EAGLE
                            with lookup only: drafter 'lookup' has no directory to carry one.
    datastore_min_ngram / datastore_max_ngram   suffix lengths matched against the datastore, longest first.
    datastore_min_share     the chain grows while its next token follows at least this share of the occurrences.
    token_prob              merged into a drafter that scores its nodes (EAGLE: its path log-probs) under a node
                            budget, a prompt-lookup node counts as token_prob[n - 1] for its step from its parent, n
                            the length of the n-gram its continuation matched (the last entry for longer ones), so
                            the best candidates of all sources fill the budget (`runtime.drafters.merged`).
                            Measured on 52 training-held-out / held-out prose / calibration prompts with the
                            SmolLM2 head (EAGLE-2, 16 nodes): given its parent on the target's path, a node of a
                            continuation that matched 1 / 2 / 3 tokens was there 22-78% / 52-72% / 78-92% of the
                            time (depth 1-4); a flat 0.6 ranked a 1-token match above the head's likelier guesses
                            and a 3-token match below them (demo/smollm2/README.md).
    datastore_token_prob    the same for a datastore node (one probability: its share of the stored continuations
                            ranked no better; 0.4-0.5 ranked alike on those prompts, 0.6-0.7 lower).
    """

    max_ngram: int = setting(3, ge=1)
    min_ngram: int = setting(1, ge=1)
    num_draft_tokens: int = setting(10, ge=1)
    max_depth: int | None = setting(6, ge=1)
    max_branches: int = setting(4, ge=1)
    datastore_tokens: int = setting(0, ge=0)
    datastore_min_ngram: int = setting(3, ge=1)
    datastore_max_ngram: int = setting(5, ge=1)
    datastore_min_share: float = setting(0.3, ge=0.0, le=1.0)
    token_prob: tuple[float, ...] = setting((0.3, 0.55, 0.85), nonempty=True)
    datastore_token_prob: float = setting(0.5, gt=0.0, le=1.0)

    def __post_init__(self) -> None:
        schema.check(self, ConfigError, "lookup")
        object.__setattr__(self, "token_prob", tuple(self.token_prob))  # JSON / YAML give a list
        if not all(0.0 < p <= 1.0 for p in self.token_prob):  # `not <=`: NaN is out
            raise ConfigError(f"lookup.token_prob: got {list(self.token_prob)}, expected numbers in (0, 1], one per "
                              "matched n-gram length")
        for low, high in (("min_ngram", "max_ngram"), ("datastore_min_ngram", "datastore_max_ngram")):
            if getattr(self, low) > getattr(self, high):
                raise ConfigError(
                    f"lookup option {low} ({getattr(self, low)}) must not exceed {high} ({getattr(self, high)})"
                )

    @property
    def depth_limit(self) -> int:
        return self.num_draft_tokens if self.max_depth is None else min(self.max_depth, self.num_draft_tokens)

    def ngram_token_prob(self, n: int) -> float:
        """What a node of a prompt-lookup continuation that matched n tokens counts as, per token (`token_prob`)."""
        return self.token_prob[min(n, len(self.token_prob)) - 1]


@dataclass(frozen=True)
class PruneOptions:
    """Which of a step's draft nodes are verified (EAGLE, static or dynamic tree).

    min_path_prob   a node is verified only if the head's probability of its path (the product of its draft
                    probabilities from the root down: EAGLE-2's score) is at least this; 0: every node is. A path
                    is never likelier than its parent's, so what is kept is a tree; prompt-lookup nodes merged
                    under a kept node stay. On CPU every node beyond ~8 costs a share of a target step (the
                    matmuls are compute-bound there), while the head's path probability tracks how often the target
                    accepts the node: a node the head gives 1% is accepted about 1% of the time.
    by_cost         also cut each step's tree to the node count that maximises its expected tokens per unit of
                    target-forward cost (`runtime.tree.cost_budget`), the cost of verifying 1, 2, ... nodes
                    measured on this machine when the decoder is built (`runtime.verify_cost`): a CPU whose
                    forward of 8 rows costs twice one row's verifies a few nodes a step, a GPU whose forward of 32
                    costs what one does keeps the whole tree. The cut reads the drafter's scores and that curve,
                    never the target, so verification stays exact; a seeded sampled request draws the same tokens
                    only under the same curve (the same decoder).
    """

    min_path_prob: float = setting(0.0, ge=0.0, le=1.0)
    by_cost: bool = setting(False)

    def __post_init__(self) -> None:
        schema.check(self, ConfigError, "pruning")

    @property
    def min_score(self) -> float:
        """The cumulative log-probability (a node's score) a verified node needs; a floor of 0 counts as 1e-300, so
        that nodes never drafted, scored -inf, stay below it."""
        return math.log(max(self.min_path_prob, 1e-300))


OPTIONS: dict[str, type] = {"dynamic": DynamicTreeOptions, "lookup": LookupOptions,
                            "pruning": PruneOptions}  # DraftSpec field -> its type
# Their field names never overlap, so KEY=VALUE options are routed to their set by name.


def option_names(kind: str) -> tuple[str, ...]:
    """The KEY=VALUE options drafter `kind` takes (the fields of its option sets)."""
    return tuple(f.name for name in drafter_kind(kind).options for f in dataclasses.fields(OPTIONS[name]))


# ---- drafter kinds ------------------------------------------------------------------------------------------------

PLAIN = "none"  # the kind of plain decoding (runtime/drafters/none.py), DraftSpec's default
# The kind modules the registry loads, in the order kinds are listed; eagle3 before eagle: `infer_draft_kind` takes
# the first kind that recognizes a head directory, and an EAGLE-3 head is a one-layer head too.
BUILTIN_KINDS = ("runtime.drafters.medusa", "runtime.drafters.eagle3", "runtime.drafters.eagle",
                 "runtime.drafters.lookup", "runtime.drafters.none")


class DrafterKind:
    """A drafter kind: what the runtime knows of it. Its module subclasses this and names the instance `KIND`."""

    name: ClassVar[str]
    title: ClassVar[str]  # for people: "Medusa", "prompt lookup"
    weighted: ClassVar[bool] = False  # drafts from head weights (DraftSpec.path), needed to load
    weight_files: ClassVar[tuple[str, ...]] = ()  # its head's weight files, preferred first
    # the option sets it takes (keys of OPTIONS); "lookup" on a weighted kind: prompt lookup merged into its trees
    options: ClassVar[tuple[str, ...]] = ()
    quantizations: ClassVar[tuple[str, ...]] = ()  # the DraftSpec.quantization values its head runs in
    sized_by: ClassVar[str] = "tree"  # the DraftSpec field (dotted into an option set) that sets its tree's size

    def check(self, spec: DraftSpec) -> None:
        """Its own rules on `spec`, after the generic ones: DraftSpecError naming the field."""

    def shape(self, spec: DraftSpec) -> tuple[int, int]:
        """(most tree nodes, root included; deepest node) of what `spec` drafts when its tree is not static and no
        prompt lookup is merged in."""
        return 1, 0

    def merged_shape(self, spec: DraftSpec, nodes: int, depth: int) -> tuple[int, int]:
        """The same with prompt lookup merged into a tree of `nodes` nodes (`depth`: the deeper of the two):
        lookup's nodes come on top of the tree's."""
        return nodes + spec.lookup.num_draft_tokens + spec.lookup.datastore_tokens, depth

    def load(self, spec: DraftSpec, model: Any) -> Any:
        """The drafter (a `runtime.protocol.Drafter`) `spec` describes for the target `model`, its defaults
        resolved; prompt lookup merged in is `runtime.drafters.load_drafter`'s."""
        raise NotImplementedError(f"drafter kind {self.name!r} has no loader")

    def recognizes(self, directory: Path) -> bool:
        """Whether `directory` holds this kind's head in its public format (`runtime.api.infer_draft_kind`)."""
        return False

    def with_tree(self, drafter: Any, model: Any, tree: Tree, pruning: PruneOptions | None = None) -> Any:
        """A loaded drafter's weights drafting another static tree, no weights read again (tune-tree)."""
        raise ConfigError(f"drafter {self.name!r} drafts no static tree from head weights")

    def max_depth(self, drafter: Any) -> int | None:
        """The deepest static tree a loaded drafter drafts (None: no bound)."""
        return None


_KINDS: Registry[DrafterKind] = Registry("drafter kind", DrafterKind, BUILTIN_KINDS)


def kinds() -> tuple[DrafterKind, ...]:
    """Every registered kind: the built-in ones, then those `register`ed."""
    return _KINDS.all()


def kind_names() -> tuple[str, ...]:
    return tuple(kind.name for kind in kinds())


def drafter_kind(name: str) -> DrafterKind:
    """The kind named `name`; DraftSpecError("kind") when none is."""
    kind = _KINDS.get(name)
    if kind is None:
        raise DraftSpecError("kind", f"unknown drafter kind {name!r}; expected one of {', '.join(kind_names())}")
    return kind


def register(kind: DrafterKind) -> DrafterKind:
    """Add a kind from outside BUILTIN_KINDS (its module calls this); the same object again is a no-op."""
    return _KINDS.register(kind)


def unregister(name: str) -> None:
    """Remove a kind `register` added."""
    _KINDS.unregister(name)


def _their(names: Sequence[str]) -> str:
    return " / ".join(names) if names else "no drafter's"


# ---- trees ------------------------------------------------------------------------------------------------------


def as_tree(tree: Tree | str | Sequence[Sequence[int]] | None) -> Tree | None:
    """A Tree, a preset name / JSON list of paths (see `Tree.parse`), or a list of choice paths."""
    if tree is None or isinstance(tree, Tree):
        return tree
    if isinstance(tree, str):
        return Tree.parse(tree)
    if isinstance(tree, Sequence):
        return Tree.from_choices(tree) if len(tree) else Tree.root_only()
    raise ConfigError(f"tree must be a Tree, a preset name or a list of choice paths, got {type(tree).__name__}")


def _tree(value: Any) -> Tree | Literal["dynamic"] | None:
    if isinstance(value, str) and value.strip() == DYNAMIC:
        return DYNAMIC
    try:
        return as_tree(value)
    except ConfigError as exc:
        raise DraftSpecError("tree", str(exc)) from exc


def _no_dynamic_tree(kind: DrafterKind) -> str:
    if kind.weighted:
        return f"the dynamic tree is EAGLE-2's; {kind.title} needs a static tree (a preset or choice paths)"
    return f"the dynamic tree is EAGLE-2's, not drafter {kind.name!r}'s"


def _titles(option_set: str) -> list[str]:
    return [k.title for k in kinds() if option_set in k.options]


def _weighted() -> list[str]:
    return [k.name for k in kinds() if k.weighted]


def _pairs(options: Any) -> str:
    return ", ".join(f"{k} {v}" for k, v in dataclasses.asdict(options).items())


# ---- the spec ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DraftSpec:
    """Which drafter (see the module docstring): kind, head weights, tree, options, max draft length."""

    kind: str = PLAIN
    path: str | None = None
    tree: Tree | Literal["dynamic"] | None = None
    dynamic: DynamicTreeOptions | None = None
    lookup: LookupOptions | None = None
    max_draft_len: int | None = None
    quantization: str | None = None
    pruning: PruneOptions | None = None  # PruneOptions() (nothing pruned) is kept as None: one form per meaning

    def __post_init__(self) -> None:
        kind, tree = drafter_kind(self.kind), self.tree
        if isinstance(self.path, Path):
            object.__setattr__(self, "path", str(self.path))
        if self.path is not None:
            if not isinstance(self.path, str) or not self.path:
                raise DraftSpecError("path", f"expected a directory path, got {self.path!r}")
            if not kind.weighted:
                raise DraftSpecError("path", f"drafter {self.kind!r} has no weights; got {self.path!r}")
        if tree is not None and tree != DYNAMIC and not isinstance(tree, Tree):
            raise DraftSpecError("tree", f"expected a Tree, {DYNAMIC!r} or None, got {tree!r} "
                                         "(DraftSpec.create parses preset names, JSON and choice paths)")
        for name, cls in OPTIONS.items():
            value = getattr(self, name)
            if value is not None and not isinstance(value, cls):
                raise DraftSpecError(name, f"expected {cls.__name__}, got {value!r}")
        if self.pruning is not None:
            if "pruning" not in kind.options:
                raise DraftSpecError("pruning", f"pruning by path probability is {_their(_titles('pruning'))}'s "
                                                f"(its head scores its paths), not drafter {self.kind!r}'s")
            if self.pruning == PruneOptions():
                object.__setattr__(self, "pruning", None)
        if self.dynamic is not None:
            if "dynamic" not in kind.options:
                raise DraftSpecError("dynamic", _no_dynamic_tree(kind))
            if isinstance(tree, Tree):
                raise DraftSpecError("dynamic", "options apply to the dynamic EAGLE-2 tree only; got a static tree "
                                                "too")
            if tree is None:
                object.__setattr__(self, "tree", tree := DYNAMIC)
        if tree == DYNAMIC and "dynamic" not in kind.options:
            raise DraftSpecError("tree", _no_dynamic_tree(kind))
        if self.lookup is not None:
            if "lookup" not in kind.options:
                own = [k.name for k in kinds() if "lookup" in k.options and not k.weighted]
                merged = [k.name for k in kinds() if "lookup" in k.options and k.weighted]
                raise DraftSpecError("lookup", f"lookup options apply to drafter {_their([repr(n) for n in own])}, "
                                               f"or to {_their(merged)} (prompt-lookup continuations merged into "
                                               f"their trees), not {self.kind!r}")
            if self.lookup.datastore_tokens and not kind.weighted:
                raise DraftSpecError("lookup", f"datastore_tokens {self.lookup.datastore_tokens}: a datastore is read "
                                               f"from a draft head's directory ({_their(_weighted())} + lookup), and "
                                               f"drafter {self.kind!r} has none; set datastore_tokens to 0")
        m = self.max_draft_len
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 0):
            raise DraftSpecError("max_draft_len", f"got {m!r}, expected an integer >= 0")
        if self.quantization is not None:
            if self.quantization not in QUANTIZATIONS:
                raise DraftSpecError("quantization", f"got {self.quantization!r}, expected one of "
                                                     f"{', '.join(QUANTIZATIONS)} (or none: the weights' own dtype)")
            if self.quantization not in kind.quantizations:
                quantized = [k.name for k in kinds() if self.quantization in k.quantizations]
                raise DraftSpecError("quantization", f"drafter {self.kind!r} runs its weights as they are; "
                                                     f"{self.quantization} draft weights are {_their(quantized)}'s")
        kind.check(self)

    # ---- making one ---------------------------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        kind: str,
        *,
        path: str | Path | None = None,
        tree: Tree | str | Sequence[Sequence[int]] | None = None,
        options: Mapping[str, Any] | None = None,
        max_draft_len: int | None = None,
        quantization: str | None = None,
    ) -> DraftSpec:
        """From loose values: `tree` a Tree, a preset name ("mc_sim_7b_63", "chain-4"), JSON choice paths, a list
        of choice paths or "dynamic"; `options` the kind's options by name (eagle: total_tokens, depth, top_k,
        min_path_prob; lookup: max_ngram, min_ngram, num_draft_tokens, max_depth, max_branches; medusa / eagle also
        take lookup's, which merge prompt-lookup continuations into their trees)."""
        spec = cls(kind, path=path, tree=_tree(tree), max_draft_len=max_draft_len, quantization=quantization)
        return spec.with_options(options or {})

    def with_options(self, options: Mapping[str, Any]) -> DraftSpec:
        """This spec with `options` (the kind's options by name) set key by key over its own options, or over the
        defaults when it has none."""
        if not options:
            return self
        allowed = option_names(self.kind)
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise DraftSpecError("options", f"unknown option(s) {unknown} for drafter {self.kind!r}; accepted: "
                                            f"{sorted(allowed) if allowed else 'none'}")
        changes: dict[str, Any] = {}
        for name in drafter_kind(self.kind).options:
            cls = OPTIONS[name]
            fields = {f.name for f in dataclasses.fields(cls)}
            mine = {k: v for k, v in options.items() if k in fields}
            if not mine:
                continue
            if name == "dynamic" and isinstance(self.tree, Tree):
                raise DraftSpecError("options", f"options {sorted(mine)} apply to the dynamic EAGLE-2 tree only; "
                                                "got a static tree too")
            current = getattr(self, name)
            try:
                changes[name] = dataclasses.replace(current if current is not None else cls(), **mine)
            except ConfigError as exc:
                raise DraftSpecError("options", str(exc)) from exc
        return dataclasses.replace(self, **changes)

    @classmethod
    def parse(cls, text: str) -> DraftSpec:
        """KIND[:TREE][+KEY=VALUE...], as `python -m perf` takes drafters: KIND a registered kind; TREE a preset
        (mc_sim_7b_63, chain-K), JSON choice paths ([[0],[0,0],[1]]) or "dynamic" (EAGLE-2); KEY=VALUE the kind's
        options (`option_names`), max_draft_len or quantization, a value JSON, else text. E.g. "medusa:mc_sim_7b_63",
        "eagle:dynamic+total_tokens=30", "lookup+max_ngram=4", "medusa:chain-1+max_draft_len=1",
        "eagle:chain-3+num_draft_tokens=6" (an EAGLE chain with up to 6 prompt-lookup nodes merged in)."""
        raw = text.strip()
        if not raw:
            raise DraftSpecError("kind", f"got an empty string, expected {GRAMMAR}")
        head, *items = raw.split("+")
        kind, sep, tree = head.partition(":")
        if sep and not tree.strip():
            raise DraftSpecError("tree", "empty tree after ':'")
        options: dict[str, Any] = {}
        for item in items:
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq or not key:
                raise DraftSpecError("options", f"option {item!r} must look like KEY=VALUE")
            if key in options:
                raise DraftSpecError("options", f"option {key!r} is given twice")
            options[key] = option_value(value.strip())
        max_draft_len = options.pop("max_draft_len", None)
        quantization = options.pop("quantization", None)
        return cls.create(kind.strip(), tree=tree.strip() if sep else None, options=options,
                          max_draft_len=max_draft_len, quantization=quantization)

    @classmethod
    def from_mapping(cls, data: Any) -> DraftSpec:
        """engine.json's "draft" record (the inverse of `to_dict`): method, path, tree ({"kind": "static", "choices":
        [...]}, {"kind": "dynamic", ...} or null), options (the kind's, by name), and max_draft_len / quantization
        when recorded (the keys: FIELD_NAMES' `record`)."""
        key = {name: names.record for name, names in FIELD_NAMES.items()}
        if not isinstance(data, Mapping):
            raise DraftSpecError("kind", f"expected a mapping with keys {key['kind']}, {key['path']}, {key['tree']}, "
                                         f"{key['options']}, got {data!r}")
        if key["kind"] not in data:
            raise DraftSpecError("kind", f"missing key {key['kind']!r}")
        record, options = data.get(key["tree"]) or None, data.get(key["options"]) or {}
        tree: Any = None
        if isinstance(record, Mapping) and record.get("kind") == "static" and isinstance(record.get("choices"), list):
            tree = record["choices"]
        elif isinstance(record, Mapping) and record.get("kind") == DYNAMIC:
            tree = DYNAMIC
        elif record is not None:
            raise DraftSpecError("tree", "expected null, {'kind': 'static', 'choices': [[...], ...]} or {'kind': "
                                         f"'dynamic', ...}}, got {record!r}")
        if not isinstance(options, Mapping):
            raise DraftSpecError("options", f"expected a mapping of option names to values, got {options!r}")
        return cls.create(data[key["kind"]], path=data.get(key["path"]), tree=tree, options=options,
                          max_draft_len=data.get(key["max_draft_len"]), quantization=data.get(key["quantization"]))

    # ---- reading one ------------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, in engine.json's "draft" record form: method, path, tree, options (+ max_draft_len /
        quantization when set)."""
        tree: dict[str, Any] | None = None
        if isinstance(self.tree, Tree):
            tree = {"kind": "static", "choices": [list(p) for p in self.tree.choices],
                    "num_nodes": self.tree.num_nodes, "max_depth": self.tree.max_depth}
        elif self.tree == DYNAMIC:
            tree = {"kind": DYNAMIC, **({} if self.dynamic is None else dataclasses.asdict(self.dynamic))}
        options = {k: v for name in OPTIONS if (o := getattr(self, name)) is not None
                   for k, v in dataclasses.asdict(o).items()}
        key = {name: names.record for name, names in FIELD_NAMES.items()}
        d: dict[str, Any] = {key["kind"]: self.kind, key["path"]: self.path, key["tree"]: tree,
                             key["options"]: options}
        if self.max_draft_len is not None:
            d[key["max_draft_len"]] = self.max_draft_len
        if self.quantization is not None:
            d[key["quantization"]] = self.quantization
        return d

    def describe(self) -> str:
        """One line for people, e.g. "medusa (weights heads/, static tree: 4 nodes, depth 3)"."""
        parts = []
        if self.path is not None:
            parts.append(f"weights {self.path}")
        if isinstance(self.tree, Tree):
            parts.append(f"static tree: {self.tree.num_nodes} nodes, depth {self.tree.max_depth}")
        elif self.tree == DYNAMIC:
            parts.append("dynamic tree" + ("" if self.dynamic is None else f": {_pairs(self.dynamic)}"))
        elif self.drafter_kind.weighted:
            parts.append("the drafter's default tree")
        if self.lookup is not None:
            parts.append(f"merged prompt lookup: {_pairs(self.lookup)}" if self.merges_lookup else _pairs(self.lookup))
        if self.pruning is not None:
            parts.append(f"paths below probability {self.pruning.min_path_prob:g} pruned"
                         + (", trees cut by measured verify cost" if self.pruning.by_cost else ""))
        if self.max_draft_len is not None:
            parts.append(f"max_draft_len {self.max_draft_len}")
        if self.quantization is not None:
            parts.append(f"{self.quantization} draft weights")
        return self.kind + (f" ({', '.join(parts)})" if parts else "")

    @property
    def drafter_kind(self) -> DrafterKind:
        return drafter_kind(self.kind)

    @property
    def plain(self) -> bool:
        """Whether this is plain decoding (root-only trees)."""
        return self.kind == PLAIN

    @property
    def static_tree(self) -> Tree | None:
        """The static tree, or None (dynamic, lookup, root-only or the drafter's default)."""
        return self.tree if isinstance(self.tree, Tree) else None

    @property
    def merges_lookup(self) -> bool:
        """Whether prompt-lookup continuations are merged into a model drafter's trees (a weighted kind + lookup)."""
        return self.lookup is not None and self.drafter_kind.weighted

    @property
    def model_only(self) -> DraftSpec:
        """This spec without the merged prompt lookup: the model drafter alone (what TensorRT-LLM can run)."""
        return dataclasses.replace(self, lookup=None) if self.merges_lookup else self

    def require_weights(self) -> None:
        """DraftSpecError unless the weights a drafter of this kind loads are given."""
        if self.drafter_kind.weighted and self.path is None:
            raise DraftSpecError("path", f"required for drafter {self.kind!r} (its head weights directory)")

    @property
    def draft_nodes(self) -> int:
        """Most draft nodes per step (root excluded) of the tree this spec drafts, before max_draft_len."""
        return self._shape()[0] - 1

    @property
    def max_tree_depth(self) -> int:
        """Deepest draft node of the tree this spec drafts (TensorRT-LLM's num_eagle_layers for EAGLE)."""
        return self._shape()[1]

    def _shape(self) -> tuple[int, int]:
        """(most tree nodes, root included; deepest node)."""
        if self.merges_lookup:
            nodes, depth = self.model_only._shape()
            lk = self.lookup
            return self.drafter_kind.merged_shape(self, nodes, max(depth, lk.depth_limit, lk.datastore_tokens))
        if isinstance(self.tree, Tree):
            return self.tree.num_nodes, self.tree.max_depth
        return self.drafter_kind.shape(self)


def option_value(text: str) -> Any:
    """A KEY=VALUE option's value: JSON (numbers, true / false, null, lists), else the text itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


__all__ = [
    "BUILTIN_KINDS", "DYNAMIC", "FIELD_NAMES", "FRONT_ENDS", "GRAMMAR", "OPTIONS", "PLAIN", "QUANTIZATIONS",
    "DraftSpec", "DraftSpecError", "DrafterKind", "DynamicTreeOptions", "FieldNames", "LookupOptions", "PruneOptions",
    "as_tree", "drafter_kind", "field_names", "kind_names", "kinds", "option_names", "option_value", "register",
    "unregister",
]
