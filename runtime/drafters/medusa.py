"""Medusa-1 heads (FasterDecoding/Medusa) drafting a static tree.

Head i = Linear(H -> V, no bias)(ResBlock^n(h)), ResBlock(x) = x + SiLU(Linear(H -> H, bias)(x)). Applied to
h_{L-1} (the hidden state whose lm_head output produced the root x_L), head i predicts x_{L+1+i}: the token
i + 2 positions after h's own position, i.e. tree depth i + 1.

Checkpoint format (FasterDecoding): a directory with
    config.json                    medusa_num_heads, medusa_num_layers (maybe hidden_size, vocab_size,
                                   base_model_name_or_path)
    medusa_lm_head.safetensors     or medusa_lm_head.pt (a torch state dict, loaded with weights_only=True)
holding `nn.ModuleList([nn.Sequential(ResBlock * n, nn.Linear(H, V, bias=False))] * heads).state_dict()`:
    {h}.{l}.linear.weight [H, H], {h}.{l}.linear.bias [H]   for l < n
    {h}.{n}.weight        [V, H]
With a reduced draft vocabulary (`runtime.drafters.draft_vocab`: `d2t` / `t2d` in the same file, EAGLE-3's keys)
{h}.{n}.weight is [K, H] over those K tokens, and drafted ids are mapped back to the target's.
(FasterDecoding builds the layers as `[ResBlock(H)] * n`, one module repeated, so for n > 1 its files hold the
same tensors under every l; reading each l separately loads those and independently trained layers alike.)

Static tree layout (Medusa's tree_indices): a node of rank r at depth d takes the r-th top token of head
d - 1, so siblings under different parents at the same depth share one candidate list.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from runtime.checkpoint import read_head_state
from runtime.draft_spec import DraftSpec, DrafterKind, PruneOptions
from runtime.drafters.draft_vocab import DraftVocab
from runtime.errors import CheckpointError, ConfigError
from runtime.files import read_json_object
from runtime.protocol import Draft, Proposal
from runtime.tree import Tree

NAME = "medusa"
CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "medusa_lm_head.safetensors"
TORCH_FILE = "medusa_lm_head.pt"
WEIGHT_FILES = (SAFETENSORS_FILE, TORCH_FILE)  # preferred first
DEFAULT_TREE = "mc_sim_7b_63"  # for heads at least as many as its depth; fewer heads: a chain as deep as they are


@dataclass(frozen=True)
class MedusaConfig:
    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int  # rows of each head's output layer: the draft vocabulary's size when it is reduced
    base_model_name_or_path: str | None = None


class MedusaHeads(nn.Module):
    """All heads batched: one bmm per layer over the head axis."""

    def __init__(self, config: MedusaConfig, dtype: torch.dtype = torch.float32,
                 vocab: DraftVocab | None = None) -> None:
        super().__init__()
        self.config = config
        self.vocab = vocab  # reduced draft vocabulary (None: the heads score the target's whole vocabulary)
        h, v, k, n = config.hidden_size, config.vocab_size, config.num_heads, config.num_layers
        self.res_weight = nn.Parameter(torch.zeros(k, n, h, h, dtype=dtype), requires_grad=False)  # [k, n, out, in]
        self.res_bias = nn.Parameter(torch.zeros(k, n, h, dtype=dtype), requires_grad=False)  # [k, n, H]
        self.lm_weight = nn.Parameter(torch.zeros(k, v, h, dtype=dtype), requires_grad=False)  # [k, V, H]

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """hidden # [T, H] -> logits # [num_heads, T, V] float32 (the first num_heads heads; default all)."""
        k = self.config.num_heads if num_heads is None else num_heads
        if not 1 <= k <= self.config.num_heads:
            raise ConfigError(f"num_heads must be in [1, {self.config.num_heads}], got {k}")
        x = hidden.to(self.lm_weight.dtype).unsqueeze(0).expand(k, -1, -1)  # [k, T, H]
        for layer in range(self.config.num_layers):
            w = self.res_weight[:k, layer]  # [k, H, H]
            b = self.res_bias[:k, layer]  # [k, H]
            x = x + torch.nn.functional.silu(torch.baddbmm(b.unsqueeze(1), x, w.transpose(1, 2)))
        return torch.bmm(x, self.lm_weight[:k].transpose(1, 2)).float()  # [k, T, V]


def _read_config(path: Path) -> dict:
    cfg_path = path / CONFIG_FILE
    if not cfg_path.is_file():
        raise CheckpointError(f"Medusa head directory {path} has no {CONFIG_FILE}")
    return read_json_object(cfg_path, CheckpointError)


def _positive_int(cfg: dict, key: str, path: Path, minimum: int) -> int:
    if key not in cfg:
        raise CheckpointError(f"{path / CONFIG_FILE} lacks {key!r} (a FasterDecoding Medusa config has it)")
    value = cfg[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise CheckpointError(f"{path / CONFIG_FILE}: {key} must be an integer >= {minimum}, got {value!r}")
    return value


def load_medusa_heads(path: str | Path, dtype: torch.dtype | None = None) -> MedusaHeads:
    """Load and validate a FasterDecoding Medusa head directory (CPU; move it with `.to(device)`)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"Medusa head path {path} is not a directory")
    cfg = _read_config(path)
    num_heads = _positive_int(cfg, "medusa_num_heads", path, 1)
    num_layers = _positive_int(cfg, "medusa_num_layers", path, 0)
    file, state = read_head_state(path, WEIGHT_FILES, MedusaKind.title)
    d2t = {k: state.pop(k) for k in ("d2t", "t2d") if k in state}

    expected = set()
    for h in range(num_heads):
        for layer in range(num_layers):
            expected |= {f"{h}.{layer}.linear.weight", f"{h}.{layer}.linear.bias"}
        expected.add(f"{h}.{num_layers}.weight")
    missing = sorted(expected - state.keys())
    extra = sorted(state.keys() - expected)
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} key(s) {missing[:6]}")
        if extra:
            parts.append(f"unexpected {len(extra)} key(s) {extra[:6]}")
        raise CheckpointError(
            f"{file} does not match medusa_num_heads={num_heads}, medusa_num_layers={num_layers}: "
            + "; ".join(parts)
        )

    lm_key = f"0.{num_layers}.weight"
    if state[lm_key].ndim != 2:
        raise CheckpointError(f"{file}: {lm_key} has shape {tuple(state[lm_key].shape)}, expected [vocab, hidden]")
    vocab, hidden = (int(s) for s in state[lm_key].shape)
    # A reduced draft vocabulary: config.json's vocab_size is the target's, draft_vocab_size the heads' rows.
    draft_vocab = None
    if d2t:
        target_vocab = cfg.get("vocab_size")
        if not isinstance(target_vocab, int) or isinstance(target_vocab, bool):
            raise CheckpointError(f"{path / CONFIG_FILE}: a reduced draft vocabulary (d2t in {file}) needs the "
                                  f"target's vocab_size, got {target_vocab!r}")
        draft_vocab = DraftVocab.from_state(d2t, target_vocab, file)
        assert draft_vocab is not None
        if draft_vocab.size != vocab:
            raise CheckpointError(f"{file}: d2t has {draft_vocab.size} entries but {lm_key} has {vocab} rows")
    for key, found in (("hidden_size", hidden), ("vocab_size" if draft_vocab is None else "draft_vocab_size", vocab)):
        if key in cfg and cfg[key] != found:
            raise CheckpointError(f"{path / CONFIG_FILE}: {key}={cfg[key]!r} but the weights in {file} have {found}")
    config = MedusaConfig(num_heads, num_layers, hidden, vocab, cfg.get("base_model_name_or_path"))
    if dtype is None:
        dtype = state[lm_key].dtype
    heads = MedusaHeads(config, dtype, draft_vocab)
    with torch.no_grad():
        for h in range(num_heads):
            for layer in range(num_layers):
                _copy(heads.res_weight[h, layer], state, f"{h}.{layer}.linear.weight", file)
                _copy(heads.res_bias[h, layer], state, f"{h}.{layer}.linear.bias", file)
            _copy(heads.lm_weight[h], state, f"{h}.{num_layers}.weight", file)
    return heads


def _copy(dst: torch.Tensor, state: dict[str, torch.Tensor], key: str, file: Path) -> None:
    src = state[key]
    if tuple(src.shape) != tuple(dst.shape):
        raise CheckpointError(f"{file}: {key} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    if not src.is_floating_point():
        raise CheckpointError(f"{file}: {key} has dtype {src.dtype}, expected a floating-point tensor")
    dst.copy_(src)


def check_against_target(heads: MedusaHeads, hidden_size: int, vocab_size: int, where: str) -> None:
    cfg = heads.config
    if cfg.hidden_size != hidden_size:
        raise CheckpointError(
            f"{where}: Medusa head hidden size {cfg.hidden_size} does not match the target model's hidden_size "
            f"{hidden_size}"
        )
    if heads.vocab is not None:
        if heads.vocab.target_vocab != vocab_size:
            raise CheckpointError(f"{where}: Medusa heads' draft vocabulary maps into a vocabulary of "
                                  f"{heads.vocab.target_vocab} tokens, but the target model has {vocab_size}")
    elif cfg.vocab_size != vocab_size:
        raise CheckpointError(
            f"{where}: Medusa head vocab size {cfg.vocab_size} does not match the target model's vocab_size "
            f"{vocab_size}"
        )


class MedusaDrafter:
    """Shared Medusa heads + a static tree."""

    name = NAME

    def __init__(self, heads: MedusaHeads, tree: Tree, source: str = "medusa heads") -> None:
        if tree.max_depth > heads.config.num_heads:
            raise ConfigError(
                f"tree depth {tree.max_depth} exceeds the {heads.config.num_heads} Medusa heads in {source} "
                f"(head i drafts depth i + 1)"
            )
        if tree.num_nodes > 1 and max(tree.max_rank_per_depth()) > heads.config.vocab_size:
            raise ConfigError(
                f"tree needs the top-{max(tree.max_rank_per_depth())} tokens of a head but the vocabulary has "
                f"{heads.config.vocab_size}"
            )
        self.heads = heads
        self.tree = tree

    @property
    def spec(self) -> DraftSpec:
        """What it drafts: its static tree (the weights path is not kept)."""
        return DraftSpec(NAME, tree=self.tree)

    def start(self, prompt: torch.Tensor, hidden: torch.Tensor, max_nodes: int) -> MedusaSession:
        """prompt # [P] int64; hidden # [P, H]: h_0 .. h_{P-1}."""
        if not isinstance(max_nodes, int) or isinstance(max_nodes, bool) or max_nodes < 1:
            raise ConfigError(f"max_nodes must be an integer >= 1 (the root counts), got {max_nodes!r}")
        tree = self.tree
        if tree.num_nodes > max_nodes:
            # A prefix of the canonical (length, lexicographic) order is ancestor-closed: parents sort first.
            tree = Tree.from_choices(tree.choices[: max_nodes - 1]) if max_nodes > 1 else Tree.root_only()
        return MedusaSession(self.heads, tree, hidden)


class MedusaSession:
    def __init__(self, heads: MedusaHeads, tree: Tree, hidden: torch.Tensor) -> None:
        self.heads = heads
        self.tree = tree
        self.last_hidden = self._last(hidden)  # [H]: the hidden state that produced the next root
        if tree.num_nodes > 1:
            self.top_k = max(tree.max_rank_per_depth())  # candidates per head (Medusa's top-k)
            self.tree_indices = tree.medusa_tree_indices(self.top_k)  # [num_nodes]
        else:
            self.top_k = 0

    def _last(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.ndim != 2 or hidden.shape[0] == 0 or hidden.shape[1] != self.heads.config.hidden_size:
            raise ConfigError(
                f"Medusa needs hidden states [T >= 1, {self.heads.config.hidden_size}], got {tuple(hidden.shape)}"
            )
        return hidden[-1]

    def head_logits(self) -> torch.Tensor:
        """Logits of the heads the tree uses at the current position. # [max_depth, V] float32"""
        w = self.heads.lm_weight
        return self.heads(self.last_hidden.to(w.device).unsqueeze(0), self.tree.max_depth)[:, 0]

    def draft(self, root: int, params: object = None, generator: torch.Generator | None = None,
              max_nodes: int | None = None) -> Draft:
        if self.tree.num_nodes == 1:
            return Draft(self.tree, torch.tensor([int(root)], dtype=torch.int64))
        top = torch.topk(self.head_logits(), self.top_k, dim=-1).indices  # [max_depth, top_k]
        if self.heads.vocab is not None:
            top = self.heads.vocab.to_target(top)
        flat = torch.cat([torch.tensor([int(root)], device=top.device), top.reshape(-1)])  # [1 + depth*top_k]
        tokens = flat[self.tree_indices.to(flat.device)].to(torch.int64).cpu()  # [num_nodes]
        return Draft(self.tree, tokens, Proposal.DETERMINISTIC)

    def advance(self, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        """tokens # [a]; hidden # [a, H]: only the last row matters (it produced the next root)."""
        self.last_hidden = self._last(hidden)


class MedusaKind(DrafterKind):
    name = NAME
    title = "Medusa"
    weighted = True
    weight_files = WEIGHT_FILES
    options = ("lookup",)

    def shape(self, spec: DraftSpec) -> tuple[int, int]:
        raise ConfigError("a Medusa spec without a tree drafts its heads' default tree: ask the loaded drafter's "
                          "spec (load_drafter(spec, model).spec)")

    def load(self, spec: DraftSpec, model: Any) -> MedusaDrafter:
        """Its tree by default: DEFAULT_TREE, or a chain as deep as the heads when they are fewer than its depth."""
        config = model.config
        heads = load_medusa_heads(spec.path, dtype=model.dtype)
        check_against_target(heads, config.hidden_size, config.vocab_size, spec.path)
        heads = heads.to(model.device)
        tree = spec.static_tree
        if tree is None:
            n, default = heads.config.num_heads, Tree.preset(DEFAULT_TREE)
            tree = default if n >= default.max_depth else Tree.chain(n)
        return MedusaDrafter(heads, tree, source=spec.path)

    def recognizes(self, directory: Path) -> bool:
        if any((directory / name).exists() for name in WEIGHT_FILES):
            return True
        cfg = directory / CONFIG_FILE
        return cfg.exists() and "medusa_num_heads" in read_json_object(cfg, CheckpointError)

    def with_tree(self, drafter: MedusaDrafter, model: Any, tree: Tree,
                  pruning: PruneOptions | None = None) -> MedusaDrafter:
        return MedusaDrafter(drafter.heads, tree)

    def max_depth(self, drafter: MedusaDrafter) -> int:
        return drafter.heads.config.num_heads  # head i drafts depth i + 1


KIND = MedusaKind()
