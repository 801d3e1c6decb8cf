"""EAGLE-1 draft head (SafeAILab/EAGLE): static trees (EAGLE-1) or dynamic trees (EAGLE-2).

The head is an autoregressive model over *features*. Its input at position t is
    fc(cat(embed(x_{t+1}), f_t))            fc = Linear(2H -> H, bias), the embedding FIRST
where f_t is the target's hidden state h_t (final-norm output). One Llama decoder layer (layer 0 without
input_layernorm) maps it to a predicted feature f'_{t+1}; the TARGET's lm_head turns that into logits for
x_{t+2}. While drafting, a node's true feature is unknown, so a node at depth d >= 1 is fed
(its token, the head's output feature at its parent) at position L - 1 + d.

Head KV cache (slot t = pair (f_t, x_{t+1}) at position t). The committed sequence x_0 .. x_{L-1} has hidden
states h_0 .. h_{L-1}; the pair (h_{L-1}, x_L) needs the root x_L, so a session keeps the pairs it cannot or
did not yet run as *pending* and runs them, root pair last, in one causal chunk at the start of `draft`
(committed to the head cache: they are final). `advance(x_L..x_{L+a-1}, h_L..h_{L+a-1})` then adds the pairs
(h_L, x_{L+1}) .. (h_{L+a-2}, x_{L+a-1}) and keeps h_{L+a-1} for the next root. Drafted nodes are never
committed: their features were guesses, and the accepted ones are re-run with the target's real features.

Tree expansion runs one head forward per depth, on that depth's new nodes only. During a step the head cache is
a `DraftTreeCache`: each forward stores its nodes' K/V after the committed slots and the step's earlier nodes,
and its rows attend to the committed prefix plus their own ancestors among the drafted nodes (an explicit mask,
since the tree-attention op masks only the forward's own block); the step's nodes are dropped when it ends.

Pruning (`PruneOptions.min_path_prob`): a node's path probability is the product of the head's probabilities of
its tokens from the root down (EAGLE-2's score; cumulative log-probs here); nodes below the floor are not verified,
and a static tree's deeper levels are not drafted once every node of a level is below it (their children could
only be less likely). Which nodes are kept depends on the drafter's state only, never on the target, so the kept
tree is one more fixed candidate tree: verification stays exact.

Checkpoint: a directory with config.json (Llama-style, num_hidden_layers 1; "bias" (default true) says whether
fc has a bias, "qkv_bias" whether q/k/v do) and pytorch_model.bin (torch.load weights_only=True) or
model.safetensors with keys fc.weight, fc.bias, layers.{i}.self_attn.{q,k,v,o}_proj.weight,
layers.{i}.post_attention_layernorm.weight, layers.{i}.mlp.{gate,up,down}_proj.weight (layers i > 0 also
input_layernorm.weight) and optionally embed_tokens.weight (otherwise the target's embedding is shared), and
optionally a reduced draft vocabulary (`d2t` / `t2d`, EAGLE-3's keys; `runtime.drafters.draft_vocab`): the head then
scores only those K rows of the target's lm_head and maps its picks back to target ids.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from plugins.draft_layer import native as native_layer
from plugins.tree_attention.mask import unpack_mask
from runtime.checkpoint import IGNORED_SUFFIXES, read_head_state
from runtime.config import ModelConfig
from runtime.draft_spec import DYNAMIC, QUANTIZATIONS, DraftSpec, DrafterKind, DynamicTreeOptions, PruneOptions
from runtime.drafters.draft_vocab import DraftVocab
from runtime.errors import CheckpointError, ConfigError, SpectreeError
from runtime.files import read_json_object
from runtime.kv_cache import KVCache
from runtime.model import (QUANT_MAX_ROWS, QUANTIZED_WEIGHTS, AttendingCache, DecoderLayer, Int8Weight, PackedWeight,
                           QuantizedWeight, causal_mask, linear)
from runtime.protocol import Draft, Proposal
from runtime.tree import CandidatePool, Tree, deeper_pays, expand_frontier, pruned_pool, select_dynamic_tree

NAME = "eagle"
CONFIG_FILE = "config.json"
TORCH_FILE = "pytorch_model.bin"
SAFETENSORS_FILE = "model.safetensors"
WEIGHT_FILES = (TORCH_FILE, SAFETENSORS_FILE)  # preferred first
_MAX_LISTED = 6
_MIN_CACHE = 256  # initial head-cache capacity beyond the prompt; doubled on demand


class DraftStateError(SpectreeError, RuntimeError):
    """A session was driven out of order (e.g. advance() whose first token is not the drafted root)."""


class EagleHead(nn.Module):
    """fc + decoder layer(s); state-dict names are the EAGLE checkpoint's (fc.*, layers.{i}.*, embed_tokens.*)."""

    fc_quantized: QuantizedWeight | None = None  # set by quantize()
    fc_packed: PackedWeight | None = None  # set by pack()
    # set by quantize(Int8Weight) where the layer runs as one native call (plugins/draft_layer): forwards of at most
    # QUANT_MAX_ROWS rows (a step's) take it
    native: native_layer.EagleLayerWeights | None = None

    def __init__(self, config: ModelConfig, fc_bias: bool, own_embedding: bool,
                 vocab: DraftVocab | None = None) -> None:
        super().__init__()
        h = config.hidden_size
        self.config = config
        self.vocab = vocab  # reduced draft vocabulary (None: the target's whole vocabulary)
        self.embed_tokens = nn.Embedding(config.vocab_size, h) if own_embedding else None
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        # EAGLE's layer 0 feeds the fused input straight to attention (no input_layernorm); later layers have it.
        self.layers = nn.ModuleList(DecoderLayer(config, i, input_norm=i > 0) for i in range(config.num_hidden_layers))
        self.register_load_state_dict_post_hook(lambda module, _keys: module._drop_copies())

    def _drop_copies(self) -> None:
        self.fc_quantized = self.fc_packed = self.native = None

    def quantize(self, kind: type[QuantizedWeight]) -> None:
        """Run every matmul of the head on quantized copies of its weights (`runtime.model.Int8Weight` /
        `Int4Weight`): drafting reads them for a few rows per call, so their bytes are its cost. Undone by any later
        move of the weights."""
        self.fc_quantized = kind.of(self.fc.weight)
        for layer in self.layers:
            layer.self_attn.quantize(kind)
            layer.mlp.quantize(kind)
        self.native = self._native_weights() if kind is Int8Weight else None

    def _native_weights(self) -> native_layer.EagleLayerWeights | None:
        """The int8 copies as the native layer reads them; None where it cannot run this head (not one layer of
        EAGLE-1's shape, or what `native_layer_weights` refuses: the torch route then runs)."""
        if len(self.layers) != 1 or self.layers[0].input_layernorm is not None:
            return None
        return native_layer_weights(self.layers[0], fc=native_layer.Int8Matrix.of(
            self.fc_quantized.q, self.fc_quantized.scales, self.fc.bias))

    def pack(self) -> None:
        """Run every matmul of the head on oneDNN-packed copies of its weights (`runtime.model.PackedWeight`: the
        same values, so the same drafts; bf16 on CPU). Undone like quantize()."""
        self.fc_packed = PackedWeight.of(self.fc.weight)
        for layer in self.layers:
            layer.self_attn.pack()
            layer.mlp.pack()

    @property
    def fc_weight(self) -> torch.Tensor | QuantizedWeight | PackedWeight:
        """fc's weight as the forward multiplies by it: its quantized or packed copy, else itself."""
        if self.fc_quantized is not None:
            return self.fc_quantized
        return self.fc.weight if self.fc_packed is None else self.fc_packed

    def _apply(self, fn, recurse=True):
        self._drop_copies()
        return super()._apply(fn, recurse)

    def output_weight(self, model: Any) -> torch.Tensor:
        """The draft output layer # [K, H]: the target's lm_head, or its rows of the reduced draft vocabulary (a copy,
        so each drafting step reads K x H instead of V x H)."""
        weight = model.lm_head_weight
        return weight if self.vocab is None else weight[self.vocab.target_ids.to(weight.device)].contiguous()

    def new_cache(self, max_len: int) -> KVCache:
        c = self.config
        return KVCache(len(self.layers), c.num_key_value_heads, c.head_dim, max_len, 1, self.fc.weight.dtype,
                       self.fc.weight.device)

    @torch.no_grad()
    def forward(
        self,
        embeds: torch.Tensor,  # [1, N, H]: embeddings of the tokens x_{t+1}
        features: torch.Tensor,  # [1, N, H]: the paired features f_t
        positions: torch.Tensor,  # [1, N] int64
        cache: KVCache,
        tree_mask: torch.Tensor,  # [1, N, ceil(N / 32)] int32 packed
    ) -> torch.Tensor:  # [1, N, H]: predicted features f'_{t+1}
        out = native_forward(self, embeds, features, positions, cache, tree_mask)
        if out is not None:
            return out
        x = linear(torch.cat([embeds, features], dim=-1), self.fc_weight, self.fc.bias)
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, cache, i, tree_mask)
        return x


def native_layer_weights(
    layer: Any,  # a head's decoder layer with int8 copies (self_attn / mlp `quantize(Int8Weight)`)
    fc: native_layer.Int8Matrix | None = None,  # EAGLE-1's fc
    input_norms: tuple[nn.Module, nn.Module] | None = None,  # EAGLE-3's input_layernorm, hidden_norm (RMSNorms)
    norm_before_residual: bool = False,  # EAGLE-3's residual
) -> native_layer.EagleLayerWeights | None:
    """The layer's int8 copies as the native layer reads them (`native_layer.EagleLayerWeights`), for EAGLE-1's and
    EAGLE-3's heads alike; None where it cannot run them (not on the CPU, no C compiler, an o_proj or MLP bias, norms
    with different eps, widths it does not take)."""
    attn, mlp, norm = layer.self_attn, layer.mlp, layer.post_attention_layernorm
    if attn.o_proj.weight.device.type != "cpu" or native_layer.load() is None:
        return None
    if attn.o_proj.bias is not None or mlp.fused_bias is not None:
        return None
    if input_norms is not None and any(n.eps != norm.eps for n in input_norms):
        return None  # the kernel takes one eps
    (qkv, o), (gate_up, down) = attn.quantized, mlp.quantized
    weights = native_layer.EagleLayerWeights(
        fc=fc, qkv=native_layer.Int8Matrix.of(qkv.q, qkv.scales, attn.fused_bias),
        o=native_layer.Int8Matrix.of(o.q, o.scales), norm=_float32_copy(norm.weight), eps=norm.eps,
        gate_up=native_layer.Int8Matrix.of(gate_up.q, gate_up.scales),
        down=native_layer.Int8Matrix.of(down.q, down.scales), inv_freq=_float32_copy(layer.rotary.inv_freq),
        num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
        input_norms=None if input_norms is None else tuple(_float32_copy(n.weight) for n in input_norms),
        norm_before_residual=norm_before_residual)
    return None if weights.unsupported() else weights


def _float32_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float32).contiguous()


def native_forward(
    head: Any,  # an EAGLE head (EagleHead, Eagle3Head) with its `native` weights (None: the torch route runs)
    embeds: torch.Tensor,  # [1, N, H]
    features: torch.Tensor,  # [1, N, H]
    positions: torch.Tensor,  # [1, N] int64
    cache: Any,
    tree_mask: torch.Tensor | None,  # [1, N, ceil(N / 32)] int32 packed
) -> torch.Tensor | None:  # [1, N, H] in the head's dtype; None: the head's torch route runs
    """The head's layer as one native call (plugins/draft_layer) where it applies: int8 weights it takes
    (`head.native`), a step's few rows (QUANT_MAX_ROWS at most) and a cache it reads (`_attention_view`)."""
    n = embeds.shape[1]
    if head.native is None or n > QUANT_MAX_ROWS or torch.compiler.is_compiling():
        return None
    view = _attention_view(cache, tree_mask, n)
    if view is None:
        return None
    kv, base, visible = view
    kv.open(n)
    out = native_layer.eagle_layer(head.native, torch.cat([embeds[0], features[0]], dim=-1), positions[0],
                                   kv.k[0, 0], kv.v[0, 0], kv.length, base, visible)
    return out.to(head.fc.weight.dtype)[None]


def _attention_view(
    cache: Any,
    tree_mask: torch.Tensor | None,  # [1, N, ceil(N / 32)] int32 with a KVCache
    n: int,
) -> tuple[KVCache, int, torch.Tensor] | None:
    """(the KV cache a head forward writes, base, visible [n, length + n - base] bool): each row attends to the cache
    slots below base and to those of [base, length + n) its row marks. None for a cache the native layer does not
    read (more than one sequence or layer, another kind of AttendingCache)."""
    if isinstance(cache, DraftTreeCache):
        kv, base, visible = cache.cache, cache.base, cache.visible
    elif isinstance(cache, KVCache) and tree_mask is not None:
        kv, base, visible = cache, cache.length, unpack_mask(tree_mask[0], n)
    else:
        return None
    return (kv, base, visible) if kv.batch == 1 and kv.num_layers == 1 and visible is not None else None


# ---- loading --------------------------------------------------------------------------------------------


def _read_config(path: Path, target: ModelConfig) -> dict[str, Any]:
    cfg_file = path / CONFIG_FILE
    if not cfg_file.is_file():
        raise CheckpointError(f"EAGLE head directory {path} has no {CONFIG_FILE}")
    raw = read_json_object(cfg_file, CheckpointError)
    for key, ours in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size)):
        if key in raw and raw[key] != ours:
            raise CheckpointError(
                f"{cfg_file}: EAGLE head {key} {raw[key]!r} does not match the target model's {key} {ours}"
            )
    return raw


def _parse_config(raw: dict[str, Any], cfg_file: Path, target: ModelConfig) -> ModelConfig:
    # A head config's token ids are not used; parse the Llama architecture fields.
    try:
        parsed = ModelConfig.from_hf({**raw, "eos_token_id": None, "bos_token_id": None, "architectures": None,
                                      "model_type": "llama", "vocab_size": target.vocab_size})
    except ConfigError as exc:
        raise CheckpointError(f"{cfg_file}: {exc}") from exc
    config = dataclasses.replace(
        parsed,
        # EAGLE's attention: q/k/v bias only when the config says qkv_bias; o_proj and the MLP never have one.
        attention_bias=bool(raw.get("qkv_bias", False)),
        o_proj_bias=False,
        mlp_bias=False,
        dtype=target.dtype,
    )
    return config


def load_eagle_head(path: str | Path, model: Any) -> EagleHead:
    """Load an EAGLE-1 head directory for `model` (a TargetModel): validated, cast to its dtype and device."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"EAGLE head path {path} is not a directory")
    target: ModelConfig = model.config
    raw = _read_config(path, target)
    file, state = read_head_state(path, WEIGHT_FILES, EagleKind.title)
    state = {k: v for k, v in state.items() if not k.endswith(IGNORED_SUFFIXES)}
    vocab = DraftVocab.from_state(state, target.vocab_size, file)
    if vocab is not None and raw.get("draft_vocab_size", vocab.size) != vocab.size:
        raise CheckpointError(f"{path / CONFIG_FILE}: draft_vocab_size {raw['draft_vocab_size']!r} but d2t in {file} "
                              f"has {vocab.size} entries")
    if "fc.weight" not in state:
        raise CheckpointError(f"{file} has no fc.weight: not an EAGLE head (keys: {sorted(state)[:_MAX_LISTED]})")
    if state["fc.weight"].ndim != 2 or state["fc.weight"].shape[1] != 2 * state["fc.weight"].shape[0]:
        raise CheckpointError(f"{file}: fc.weight has shape {tuple(state['fc.weight'].shape)}, expected [H, 2H] "
                              f"(an EAGLE-1 head{_other_kind(path)})")
    head_hidden = int(state["fc.weight"].shape[0])
    if head_hidden != target.hidden_size:
        raise CheckpointError(
            f"{file}: EAGLE head hidden size {head_hidden} (fc.weight) does not match the target model's "
            f"hidden_size {target.hidden_size}"
        )
    if "embed_tokens.weight" in state and state["embed_tokens.weight"].shape[0] != target.vocab_size:
        raise CheckpointError(
            f"{file}: EAGLE head vocab size {state['embed_tokens.weight'].shape[0]} (embed_tokens.weight) does not "
            f"match the target model's vocab_size {target.vocab_size}"
        )
    fc_bias = raw.get("bias", True)
    if not isinstance(fc_bias, bool):
        raise CheckpointError(f"{path / CONFIG_FILE}: bias must be true or false, got {fc_bias!r}")
    if "layers.0.input_layernorm.weight" in state:
        raise CheckpointError(
            f"{file} has layers.0.input_layernorm.weight: EAGLE-1 heads have no input norm in layer 0 "
            f"(this looks like an EAGLE-3 or full-model checkpoint{_other_kind(path)})"
        )

    config = _parse_config(raw, path / CONFIG_FILE, target)
    with torch.device("meta"):
        head = EagleHead(config, fc_bias, own_embedding="embed_tokens.weight" in state, vocab=vocab)
    expected = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    missing = sorted(expected.keys() - state.keys())
    extra = sorted(state.keys() - expected.keys())
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} key(s) {missing[:_MAX_LISTED]}")
        if extra:
            parts.append(f"unexpected {len(extra)} key(s) {extra[:_MAX_LISTED]}")
        raise CheckpointError(
            f"{file} does not match its config (num_hidden_layers={config.num_hidden_layers}, bias={fc_bias}, "
            f"qkv_bias={config.attention_bias}): " + "; ".join(parts)
        )
    for key, shape in expected.items():
        if tuple(state[key].shape) != shape:
            raise CheckpointError(
                f"{file}: {key} has shape {tuple(state[key].shape)}, expected {shape} from {CONFIG_FILE}"
            )
        if not state[key].is_floating_point():
            raise CheckpointError(f"{file}: {key} has dtype {state[key].dtype}, expected floating point")
    dtype, device = model.dtype, model.device
    head.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state.items()}, strict=True, assign=True)
    head.to(device)  # the RoPE buffers (built on the CPU even under the meta device) follow the weights
    head.requires_grad_(False)
    head.eval()
    return head


def _other_kind(path: Path) -> str:
    """"; drafter kind K recognizes this directory" for the first other kind that does (the message of a head of
    another kind given as an EAGLE-1 one), else ""."""
    from runtime.draft_spec import kinds

    other = next((kind.name for kind in kinds() if kind.name != NAME and kind.recognizes(path)), None)
    return "" if other is None else f"; drafter kind {other!r} recognizes this directory: load it with that kind"


# ---- drafting -------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=512)
def _kept_subtree(tree: Tree, keep: tuple[int, ...]) -> Tree:
    """tree.subtree(keep), built once per (tree, kept nodes): a pruned static tree keeps few distinct shapes."""
    return tree.subtree(keep)


def _ids(values: list[int], device: torch.device) -> torch.Tensor:  # [len(values)] int64
    return torch.tensor(values, dtype=torch.int64, device=device)


@dataclass(frozen=True)
class Expansion:
    """Filling the children of `nodes` from the head's top-k at each."""

    nodes: torch.Tensor  # [m] int64 node indices whose children are filled (on the drafting device)
    children: tuple[tuple[int, int, int, int], ...]  # per child: (its parent's row in `nodes`, the parent, its
    #                                                   sibling rank = which top-k entry it takes, the child)
    k: int  # 1 + the largest rank

    @classmethod
    def of(cls, tree: Tree, nodes: list[int], device: torch.device) -> Expansion:
        ranks = tree.ranks.tolist()
        children = tuple((row, i, ranks[c], c) for row, i in enumerate(nodes) for c in tree.children(i))
        return cls(_ids(nodes, device), children, 1 + max(rank for _, _, rank, _ in children))


@dataclass(frozen=True)
class Level:
    """One head forward of static-tree drafting: the new nodes of one depth (those with children), stored after
    the step's earlier nodes; their outputs fill their children."""

    nodes: tuple[int, ...]  # the new nodes
    new: torch.Tensor  # [b] int64: the same, on the drafting device
    parents: torch.Tensor  # [b] int64 each node's parent (its input feature is the parent's output)
    offsets: torch.Tensor  # [b] int64 depth - 1: position = cache length + offset
    visible: torch.Tensor  # [b, P + b] bool: the step's drafted nodes so far (P, in forward order) and these b
    #                        that each new node sees: its ancestors and itself
    expand: Expansion


@dataclass(frozen=True)
class StaticPlan:
    """A static tree's drafting work that does not depend on the tokens: computed once per session. A step runs
    the head forwards and top-k picks as tensor ops and keeps its tokens and scores, a few per level, in Python
    lists: drafting runs right after a target forward has pushed everything out of cache, where every small tensor
    op costs several microseconds (indexing tensors per node instead was slower)."""

    root: Expansion
    levels: tuple[Level, ...]
    forwarded: int  # draft nodes the step's head forwards store

    @classmethod
    def of(cls, tree: Tree, device: torch.device) -> StaticPlan:
        depth, parents = tree.depth.tolist(), tree.parent_list
        levels, block = [], []
        for d in range(1, tree.max_depth):
            new = [i for i in range(1, tree.num_nodes) if depth[i] == d and tree.children(i)]
            if not new:
                continue
            block += new
            visible = tree.mask[new][:, block]  # [b, P + b] ancestor-or-self among the forwarded nodes
            levels.append(Level(tuple(new), _ids(new, device), _ids([parents[i] for i in new], device),
                                _ids([depth[i] - 1 for i in new], device), visible.to(device),
                                Expansion.of(tree, new, device)))
        return cls(Expansion.of(tree, [0], device), tuple(levels), len(block))


def _float32(x: float) -> float:
    """x rounded to float32, the precision `Draft.scores` carries: each path score's sum is rounded as a float32
    addition rounds it."""
    return float(np.float32(x))


class DraftTreeCache(AttendingCache):
    """The head's cache during one drafting step. Slots [0, base) hold the committed pairs (the root's last); each
    `forward` stores its nodes after the step's earlier ones, and its rows attend to every committed slot plus the
    drafted nodes its `visible` mask names. `close()` drops the step's nodes (drafted features are guesses)."""

    def __init__(self, head: EagleHead, cache: KVCache) -> None:
        self.head = head
        self.cache = cache
        self.base = cache.length
        self._visible: torch.Tensor | None = None  # [n, drafted + n] bool, for the forward under way

    @property
    def drafted(self) -> int:
        """Draft nodes stored so far this step."""
        return self.cache.length - self.base

    @property
    def visible(self) -> torch.Tensor | None:
        """[n, drafted + n] bool: the forward under way's mask over the drafted nodes and its own (None between)."""
        return self._visible

    def forward(
        self,
        embeds: torch.Tensor,  # [n, H]
        features: torch.Tensor,  # [n, H]
        positions: torch.Tensor,  # [n] int64
        visible: torch.Tensor,  # [n, drafted + n] bool: ancestor-or-self among the drafted nodes and these
    ) -> torch.Tensor:  # [n, H]
        n = embeds.shape[0]
        if tuple(visible.shape) != (n, self.drafted + n):
            raise ValueError(f"visible must be [{n}, {self.drafted + n}], got {tuple(visible.shape)}")
        self._visible = visible
        try:
            out = self.head(embeds[None], features[None], positions[None], self, None)[0]
        finally:
            self._visible = None
        self.cache.advance(n)
        return out

    def attend(
        self,
        layer: int,
        q: torch.Tensor,  # [1, Hq, n, D]
        k: torch.Tensor,  # [1, Hkv, n, D]
        v: torch.Tensor,  # [1, Hkv, n, D]
        scale: float,
    ) -> torch.Tensor:  # [1, Hq, n, D]
        k_all, v_all = self.cache.write(layer, k, v)  # [1, Hkv, base + drafted + n, D]
        visible = self._visible
        mask = torch.ones(visible.shape[0], k_all.shape[2], dtype=torch.bool, device=q.device)  # [n, keys]
        mask[:, self.base:] = visible
        out = F.scaled_dot_product_attention(q.to(k_all.dtype), k_all, v_all, attn_mask=mask, scale=scale,
                                             enable_gqa=q.shape[1] != k_all.shape[1])
        return out.to(q.dtype)

    def close(self) -> None:
        self.cache.truncate(self.base)


class EagleDrafter:
    """Shared EAGLE head + the target (embedding, lm_head); `tree` static (EAGLE-1) or `dynamic` (EAGLE-2)."""

    name = NAME

    def __init__(
        self, head: EagleHead, model: Any, tree: Tree | None = None, dynamic: DynamicTreeOptions | None = None,
        quantization: str | None = None, pruning: PruneOptions | None = None,
    ) -> None:
        """quantization: DraftSpec.quantization; "int8" / "int4": the head and its draft output layer run on int8 /
        int4 copies of their weights (`runtime.model.Int8Weight` / `Int4Weight`; CPU). pruning: DraftSpec.pruning
        (None: every drafted node is verified)."""
        if (tree is None) == (dynamic is None):
            raise ConfigError("EagleDrafter needs exactly one of tree= (static) or dynamic= (EAGLE-2 options)")
        if head.config.hidden_size != model.config.hidden_size:
            raise CheckpointError(
                f"EAGLE head hidden size {head.config.hidden_size} does not match the target model's hidden_size "
                f"{model.config.hidden_size}"
            )
        vocab_size = model.config.vocab_size if head.vocab is None else head.vocab.size
        if tree is not None and tree.num_nodes > 1 and max(tree.max_rank_per_depth()) > vocab_size:
            raise ConfigError(f"tree ranks exceed the draft vocabulary size {vocab_size}")
        self.head = head
        self.model = model
        self.tree = tree
        self.dynamic = dynamic
        if pruning is not None and not isinstance(pruning, PruneOptions):
            raise ConfigError(f"pruning must be PruneOptions or None, got {pruning!r}")
        self.pruning = pruning
        self.min_score = None if pruning is None else pruning.min_score  # None: every node is verified
        weight = model.lm_head_weight
        self.lm_weight = head.output_weight(model)  # [K, H] the draft output layer
        if quantization is not None and quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be None or one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
        self.lm_quantized: QuantizedWeight | None = None
        self.lm_packed: PackedWeight | None = None
        self.lm_native: native_layer.Int8Matrix | None = None  # lm_quantized as the native layer's matmul reads it
        self.quantization = quantization
        kind = None if quantization is None else QUANTIZED_WEIGHTS[quantization]
        # A build plans on meta tensors: nothing to quantize or pack there, but the shapes are checked.
        if kind is not None:
            if weight.device.type != "meta" and not kind.supported(weight.dtype, weight.device):
                raise ConfigError(f"{quantization} draft weights run on CPU in bfloat16 / float32, not {weight.dtype} "
                                  f"on {weight.device.type}")
            matmuls = {name: w for name, w in head.named_parameters() if w.ndim == 2 and name != "embed_tokens.weight"}
            for name, w in {**matmuls, "draft lm_head": self.lm_weight}.items():
                if not kind.supported(weight.dtype, torch.device("cpu"), tuple(w.shape)):
                    raise ConfigError(f"quantization {quantization!r}: torch's {quantization} kernel needs "
                                      f"{kind.needs(weight.dtype)}, but {name} reads {w.shape[1]}; draft "
                                      f"this head without quantization")
        shared = head.fc_quantized  # drafters sharing one head (tune-tree's trees) quantize it once
        if shared is not None and shared.name != quantization:
            raise ConfigError(f"this EAGLE head already drafts from {shared.name} copies for another drafter; load it "
                              f"again for a drafter with quantization {quantization!r}")
        if kind is not None and weight.device.type != "meta":
            if shared is None:
                head.quantize(kind)
            self.lm_quantized = kind.of(self.lm_weight)
            if head.native is not None and self.lm_weight.shape[1] % native_layer.WIDTH_MULTIPLE == 0:
                self.lm_native = native_layer.Int8Matrix.of(self.lm_quantized.q, self.lm_quantized.scales)
        elif quantization is None and PackedWeight.supported(weight.dtype, weight.device):
            # bf16 on CPU: oneDNN-packed copies (the same values, so the same drafts; F.linear re-lays a bf16 weight
            # out on every call). int8 still drafts faster in decoding, measured side by side: half the bytes.
            if head.fc_packed is None:
                head.pack()
            self.lm_packed = PackedWeight.of(self.lm_weight)

    @property
    def spec(self) -> DraftSpec:
        """What it drafts: its static tree, or the dynamic tree and its options (the weights path is not kept)."""
        return DraftSpec(self.name, tree=self.tree if self.tree is not None else DYNAMIC, dynamic=self.dynamic,
                         quantization=self.quantization, pruning=self.pruning)

    @property
    def input_width(self) -> int:
        """The width of the target's hidden-state rows a session reads (`DraftSession.advance`)."""
        return self.model.config.hidden_size

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's hidden-state rows # [n, input_width] -> the head's input features f_t # [n, H]: EAGLE-1
        reads the final-norm state itself."""
        return hidden

    @property
    def verify_cost(self) -> tuple[float, ...] | None:
        """PruneOptions.by_cost on a static tree: the verify-cost curve (`runtime.verify_cost.verify_cost_for`, the
        decoder's rule; measured once per model on the first draft, not when a builder only plans with the drafter),
        so that a step stops drafting levels whose nodes the decoder's cut would not verify
        (`runtime.tree.deeper_pays`); None otherwise."""
        if self.tree is None:
            return None
        from runtime.verify_cost import verify_cost_for

        return verify_cost_for(self.pruning, self.model, self.tree.num_nodes)

    def draft_logits(self, features: torch.Tensor) -> torch.Tensor:
        """features # [n, H] -> logits over the draft vocabulary # [n, K] float32 (K = V without a reduced one)."""
        if self.lm_native is not None and features.shape[0] <= QUANT_MAX_ROWS:
            return native_layer.matmul(self.lm_native, features)
        weight = self.lm_quantized if self.lm_quantized is not None else self.lm_packed
        return linear(features, self.lm_weight if weight is None else weight).float()

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids # [...] -> target ids # [...]."""
        return draft_ids if self.head.vocab is None else self.head.vocab.to_target(draft_ids)

    def start(self, prompt: torch.Tensor, hidden: torch.Tensor, max_nodes: int) -> EagleSession:
        """prompt # [P] int64 (x_0 .. x_{P-1}); hidden # [P, H] (h_0 .. h_{P-1})."""
        if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1:
            raise ConfigError(f"max_nodes must be an integer >= 1 (the root counts), got {max_nodes!r}")
        tree, dynamic = self.tree, self.dynamic
        if tree is not None and tree.num_nodes > max_nodes:
            # A prefix of the canonical (length, lexicographic) order is ancestor-closed: parents sort first.
            tree = Tree.from_choices(tree.choices[: max_nodes - 1]) if max_nodes > 1 else Tree.root_only()
        if dynamic is not None and dynamic.total_tokens > max_nodes:
            dynamic = dataclasses.replace(dynamic, total_tokens=max_nodes)
        return EagleSession(self, prompt, hidden, tree, dynamic)


class EagleSession:
    def __init__(
        self,
        drafter: EagleDrafter,
        prompt: torch.Tensor,
        hidden: torch.Tensor,
        tree: Tree | None,
        dynamic: DynamicTreeOptions | None,
    ) -> None:
        self.drafter = drafter
        self.head = drafter.head
        self.model = drafter.model
        self.tree = tree
        self.dynamic = dynamic
        h = drafter.input_width
        if prompt.ndim != 1 or prompt.shape[0] == 0:
            raise ConfigError(f"prompt must be a non-empty 1-D token tensor, got shape {tuple(prompt.shape)}")
        if hidden.ndim != 2 or hidden.shape != (prompt.shape[0], h):
            raise ConfigError(
                f"hidden must be [{prompt.shape[0]}, {h}] (one row per prompt token), got {tuple(hidden.shape)}"
            )
        device = self.model.device
        self.cache = self.head.new_cache(prompt.shape[0] + _MIN_CACHE)
        feats = drafter.features(hidden.to(device, self.model.dtype))  # [P, H]: f_0 .. f_{P-1}
        # Pending pairs (f_t, x_{t+1}) not yet in the head cache, and the last feature awaiting its root.
        self.pending_features: list[torch.Tensor] = [feats[:-1]]  # [n, H] each
        self.pending_tokens: list[torch.Tensor] = [prompt[1:].to(device)]  # [n] each
        self.last_hidden = feats[-1]  # [H]
        self.drafted_root: int | None = None  # root whose pair is in the cache, until advance() arrives
        # the static tree's per-step index work, per node budget (None: the whole tree), built on first use
        self._plans: dict[int | None, tuple[Tree, StaticPlan | None]] = {}

    # ---- head cache ---------------------------------------------------------------------------------------

    def _reserve(self, n: int) -> None:
        """Grow the head cache (copying its committed slots) so that n more tokens fit."""
        c = self.cache
        if c.length + n <= c.max_len:
            return
        bigger = self.head.new_cache(max(2 * c.max_len, c.length + n + _MIN_CACHE))
        length = c.length
        if length:
            for layer in range(c.num_layers):
                bigger.write(layer, c.k[layer, :, :, :length], c.v[layer, :, :, :length])
            bigger.advance(length)
        self.cache = bigger

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.head.embed_tokens is not None:
            return self.head.embed_tokens(tokens)
        return self.model.embed(tokens)

    def _logprobs(self, features: torch.Tensor) -> torch.Tensor:
        """features # [n, H] -> log-softmax over the draft vocabulary # [n, K] float32."""
        return torch.log_softmax(self.drafter.draft_logits(features), dim=-1)

    def _run_pending(self, root: int) -> torch.Tensor:
        """Commit the pending pairs plus (last hidden, root) to the head cache; the root pair's output # [H]."""
        if self.drafted_root is not None:
            # draft() again without advance(): drop the previous root pair and redo it with this root.
            self.cache.truncate(self.cache.length - 1)
            self.drafted_root = None
        device = self.last_hidden.device
        feats = torch.cat(self.pending_features + [self.last_hidden[None]])  # [n, H]
        toks = torch.cat(self.pending_tokens + [torch.tensor([root], dtype=torch.int64, device=device)])  # [n]
        n = toks.shape[0]
        start = self.cache.length
        positions = torch.arange(start, start + n, device=device)
        self._reserve(n)
        out = self.head(self._embed(toks)[None], feats[None], positions[None], self.cache, causal_mask(n, 1, device))[0]
        self.cache.advance(n)
        self.pending_features, self.pending_tokens = [], []
        self.drafted_root = root
        return out[-1]

    # ---- protocol -----------------------------------------------------------------------------------------

    @torch.no_grad()
    def draft(self, root: int, params: object = None, generator: torch.Generator | None = None,
              max_nodes: int | None = None) -> Draft:
        """max_nodes: draft only that many nodes (a static tree: the subtree `Tree.best_nodes` keeps, so fewer
        head forwards when it is shallower; a dynamic one: total_tokens at most that)."""
        root = int(root)
        root_out = self._run_pending(root)  # [H]: predicted feature at the root's position
        if self.dynamic is not None:
            return self._draft_dynamic(root, root_out, self._dynamic_options(max_nodes))
        return self._draft_static(root, root_out, max_nodes)

    @torch.no_grad()
    def candidates(self, root: int, params: object = None, generator: torch.Generator | None = None,
                   max_nodes: int | None = None) -> CandidatePool | None:
        """The dynamic tree's whole candidate pool, entries below the pruning floor left out, before EAGLE-2 cuts it
        to total_tokens (what `draft` would keep is `select_dynamic_tree` of it); None with a static tree."""
        if self.dynamic is None:
            return None
        pool = self._pool(self._run_pending(int(root)), self._dynamic_options(max_nodes))
        min_score = self.drafter.min_score
        return pool if min_score is None else pruned_pool(pool, min_score)

    def _dynamic_options(self, max_nodes: int | None) -> DynamicTreeOptions:
        opts = self.dynamic
        if max_nodes is not None and max_nodes < opts.total_tokens:
            opts = dataclasses.replace(opts, total_tokens=max_nodes)
        return opts

    def advance(self, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        """tokens # [a] int64: x_L .. x_{L+a-1} (previous root first); hidden # [a, input_width]: h_L .. h_{L+a-1}."""
        h = self.drafter.input_width
        if tokens.ndim != 1 or tokens.shape[0] == 0 or hidden.shape != (tokens.shape[0], h):
            raise ConfigError(
                f"advance needs tokens [a >= 1] and hidden [a, {h}], "
                f"got {tuple(tokens.shape)} and {tuple(hidden.shape)}"
            )
        device = self.last_hidden.device
        tokens = tokens.to(device)
        hidden = self.drafter.features(hidden.to(device, self.last_hidden.dtype))  # [a, H]
        first = int(tokens[0])
        if self.drafted_root is None:
            # No draft since the last hidden state arrived: its pair with x_L is still pending.
            self.pending_features.append(self.last_hidden[None])
            self.pending_tokens.append(tokens[:1])
        elif first != self.drafted_root:
            raise DraftStateError(f"advance tokens[0] = {first}, but the last draft was rooted at {self.drafted_root}")
        self.pending_features.append(hidden[:-1])
        self.pending_tokens.append(tokens[1:])
        self.last_hidden = hidden[-1]
        self.drafted_root = None

    # ---- static trees (EAGLE-1) ---------------------------------------------------------------------------

    def _static_plan(self, max_nodes: int | None, device: torch.device) -> tuple[Tree, StaticPlan | None]:
        """The tree to draft for a node budget (the subtree pruning would keep) and its plan (None: root only)."""
        tree = self.tree
        assert tree is not None
        key = None if max_nodes is None or max_nodes >= tree.num_nodes else max_nodes
        if key not in self._plans:
            if key is not None:
                tree = tree.subtree(tree.best_nodes(key))
            self._plans[key] = (tree, StaticPlan.of(tree, device) if tree.num_nodes > 1 else None)
        return self._plans[key]

    def _draft_static(self, root: int, root_out: torch.Tensor, max_nodes: int | None) -> Draft:
        device = root_out.device
        tree, plan = self._static_plan(max_nodes, device)
        tokens = [root] * tree.num_nodes
        if plan is None:
            return Draft(tree, torch.tensor(tokens, dtype=torch.int64), Proposal.DETERMINISTIC)
        min_score = self.drafter.min_score
        # cumulative log-probs, when pruning (-inf: not drafted)
        scores = None if min_score is None else [0.0] + [-math.inf] * (tree.num_nodes - 1)
        out = torch.empty(tree.num_nodes, root_out.shape[0], dtype=root_out.dtype, device=device)  # [num_nodes, H]
        out[0] = root_out
        self._fill_children(plan.root, out, tokens, scores)
        self._reserve(plan.forwarded)
        step = DraftTreeCache(self.head, self.cache)
        base = step.base  # a node at depth d sits at position L - 1 + d = base - 1 + d
        costs = self.drafter.verify_cost
        depth = tree.depth.tolist() if costs is not None else None  # the levels' depths, for the cost check
        try:
            for level in plan.levels:
                if scores is not None and all(scores[i] < min_score for i in level.nodes):
                    break  # the next levels hold only their descendants: pruned too
                if costs is not None and not deeper_pays(tree, scores, depth[level.nodes[0]], costs):
                    break  # the verify-cost cut would keep none of them
                new_tokens = torch.tensor([tokens[i] for i in level.nodes], dtype=torch.int64, device=device)
                out[level.new] = step.forward(self._embed(new_tokens), out[level.parents], base + level.offsets,
                                              level.visible)
                self._fill_children(level.expand, out, tokens, scores)
        finally:
            step.close()
        if scores is None:
            return Draft(tree, torch.tensor(tokens, dtype=torch.int64), Proposal.DETERMINISTIC)
        keep = tuple(i for i, score in enumerate(scores) if score >= min_score)  # the root first; ancestor-closed
        return Draft(_kept_subtree(tree, keep), torch.tensor([tokens[i] for i in keep], dtype=torch.int64),
                     Proposal.DETERMINISTIC, scores=torch.tensor([scores[i] for i in keep], dtype=torch.float32))

    def _fill_children(self, expand: Expansion, out: torch.Tensor, tokens: list[int],
                       scores: list[float] | None = None) -> None:
        """The child of rank r of node i gets the r-th top token of the draft head at out[i] (tokens: one target id
        per node); scores (when pruning): a child's is its parent's plus the log-prob of its token."""
        feats = out[expand.nodes]
        # log-probs rank as the logits do; their top-k values then add up to path scores
        logits = self.drafter.draft_logits(feats) if scores is None else self._logprobs(feats)  # [m, K]
        top = torch.topk(logits, expand.k, dim=-1)  # [m, k]
        ids = self.drafter.to_target(top.indices).tolist()
        values = top.values.tolist() if scores is not None else None
        for row, parent, rank, kid in expand.children:
            tokens[kid] = ids[row][rank]
            if values is not None:
                # capped at 0: a rounded log-softmax can come out a hair above it, and a child must never score
                # above its parent (what is kept must stay a tree)
                scores[kid] = _float32(scores[parent] + min(values[row][rank], 0.0))

    # ---- dynamic trees (EAGLE-2) --------------------------------------------------------------------------

    def _draft_dynamic(self, root: int, root_out: torch.Tensor, opts: DynamicTreeOptions) -> Draft:
        """EAGLE-2: grow a candidate pool level by level from a top_k frontier, then keep the best total_tokens - 1."""
        if opts.total_tokens == 1:
            return Draft(Tree.root_only(), torch.tensor([root], dtype=torch.int64), Proposal.DETERMINISTIC)
        pool = self._pool(root_out, opts)
        tree, node_tokens, node_scores = select_dynamic_tree(
            pool.parents, pool.tokens, pool.scores, opts.total_tokens, root_token=root,
            min_score=self.drafter.min_score,
        )
        return Draft(tree, node_tokens, Proposal.DETERMINISTIC, scores=node_scores)

    def _pool(self, root_out: torch.Tensor, opts: DynamicTreeOptions) -> CandidatePool:
        """EAGLE-2's candidate pool below the root (root_out # [H]: the head's output at the root)."""
        device = root_out.device
        if opts.total_tokens == 1:
            empty = torch.zeros(0, dtype=torch.int64, device=device)
            return CandidatePool(empty, empty, torch.zeros(0, device=device))
        # A tree of total_tokens - 1 draft nodes is at most that deep: deeper rounds could never be selected.
        rounds = min(opts.depth, opts.total_tokens - 2)
        # The pool, in creation order: parent pool index (-1: the root), token, cumulative log-prob.
        exp = expand_frontier(torch.zeros(1, device=device), self._logprobs(root_out[None]), opts.top_k)
        to_target = self.drafter.to_target
        tokens = to_target(exp.tokens)
        pool_parent, pool_tokens, pool_scores = [torch.full_like(exp.tokens, -1)], [tokens], [exp.scores]
        pool_size = exp.tokens.shape[0]
        # The frontier: pool indices, tokens, scores, input features (the parent's output) and, once forwarded,
        # rows among the step's drafted nodes; the root's children are the first one.
        frontier = exp.frontier  # [k]
        front_tokens, front_scores = tokens[frontier], exp.scores[frontier]  # [k] each
        front_in = root_out[None].expand(frontier.shape[0], -1)  # [k, H]
        parent_rows = None  # [k] each frontier node's parent's row (None: the root, in the committed cache)
        forwarded = rounds * opts.top_k  # at most top_k frontier nodes per round
        min_score = self.drafter.min_score
        anc = torch.zeros(forwarded, forwarded, dtype=torch.bool, device=device)  # ancestor-or-self among rows
        self._reserve(forwarded)
        step = DraftTreeCache(self.head, self.cache)
        base = step.base  # a node at depth d sits at position base - 1 + d
        try:
            for level in range(1, rounds + 1):
                if min_score is not None and bool((front_scores < min_score).all()):
                    break  # every candidate from here down is pruned
                k, r0 = frontier.shape[0], step.drafted
                rows = torch.arange(r0, r0 + k, device=device)
                if parent_rows is not None:
                    anc[rows] = anc[parent_rows]
                anc[rows, rows] = True
                positions = torch.full((k,), base - 1 + level, dtype=torch.int64, device=device)
                out = step.forward(self._embed(front_tokens), front_in, positions, anc[r0 : r0 + k, : r0 + k])
                exp = expand_frontier(front_scores, self._logprobs(out), opts.top_k)
                tokens = to_target(exp.tokens)
                pool_parent.append(frontier[exp.parent])
                pool_tokens.append(tokens)
                pool_scores.append(exp.scores)
                from_row = exp.parent[exp.frontier]  # [k'] the frontier row each next frontier node extends
                frontier = pool_size + exp.frontier
                front_tokens, front_scores = tokens[exp.frontier], exp.scores[exp.frontier]
                front_in, parent_rows = out[from_row], rows[from_row]
                pool_size += exp.tokens.shape[0]
        finally:
            step.close()
        return CandidatePool(torch.cat(pool_parent), torch.cat(pool_tokens), torch.cat(pool_scores))


class EagleKind(DrafterKind):
    name = NAME
    title = "EAGLE"
    weighted = True
    weight_files = WEIGHT_FILES
    options = ("dynamic", "lookup", "pruning")
    quantizations = QUANTIZATIONS

    def shape(self, spec: DraftSpec) -> tuple[int, int]:
        """The dynamic tree (its default): total_tokens nodes, depth + 1 levels."""
        d = spec.dynamic if spec.dynamic is not None else DynamicTreeOptions()
        return d.total_tokens, min(d.depth + 1, d.total_tokens - 1)

    def merged_shape(self, spec: DraftSpec, nodes: int, depth: int) -> tuple[int, int]:
        if spec.static_tree is not None:
            return super().merged_shape(spec, nodes, depth)
        # EAGLE-2: total_tokens bounds the merged tree too (the merge keeps the best nodes of the union; the session
        # drafts within this bound: `MergedDrafter.node_budget`)
        return nodes, min(depth, nodes - 1)

    def load(self, spec: DraftSpec, model: Any) -> EagleDrafter:
        """Without a static tree: the dynamic tree, with spec.dynamic or the default options."""
        static = spec.static_tree
        dynamic = None if static is not None else spec.dynamic if spec.dynamic is not None else DynamicTreeOptions()
        return EagleDrafter(load_eagle_head(spec.path, model), model, tree=static, dynamic=dynamic,
                            quantization=spec.quantization, pruning=spec.pruning)

    def recognizes(self, directory: Path) -> bool:
        cfg = directory / CONFIG_FILE
        if not cfg.exists():
            return False
        raw = read_json_object(cfg, CheckpointError)
        return raw.get("num_hidden_layers") == 1 or any((directory / name).exists() for name in WEIGHT_FILES)

    def with_tree(self, drafter: EagleDrafter, model: Any, tree: Tree,
                  pruning: PruneOptions | None = None) -> EagleDrafter:
        return type(drafter)(drafter.head, model, tree=tree, quantization=drafter.quantization, pruning=pruning)


KIND = EagleKind()
