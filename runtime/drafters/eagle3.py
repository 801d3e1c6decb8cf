"""EAGLE-3 draft head (SafeAILab/EAGLE, arXiv 2503.01840), in the public layout vLLM, SGLang and TensorRT-LLM load.

The head reads three of the target's layers, not its last one. At committed position t its feature is
    g_t = fc(cat(a_t^low, a_t^mid, a_t^high))         fc = Linear(3 * H -> H), no bias unless config "bias"
where a_t^j is the residual stream entering target layer j (`runtime.model`'s feature layers: vLLM's and SGLang's
aux hidden states). One decoder layer ("midlayer") maps (embedding of x_{t+1}, g_t) to its output o_t:
    h = hidden_norm(g);  q, k, v = proj(cat(input_layernorm(embed(x_{t+1})), h))     (2H wide)
    x = g + o_proj(attention);  o = x + mlp(post_attention_layernorm(x))
(the residual is h instead of g when config "norm_before_residual", vLLM's option). The head predicts x_{t+2} with
its own output layer over its draft vocabulary: lm_head(norm(o)) # [K], mapped to target ids by d2t. While drafting,
a node at depth d >= 1 is fed (its token, its parent's o) at position L - 1 + d: its parent's pre-norm output
stands in for the feature, as in EAGLE-1. So drafting is EAGLE-1's (`runtime.drafters.eagle`: static trees, EAGLE-2's
dynamic tree, pruning, the reduced vocabulary, int8 / int4 weights), with this head and these features. With int8
weights on the CPU the midlayer runs as one native call (`plugins/draft_layer`, as EAGLE-1's layer does), the fc over
the target's features through torch's int8 kernel.

Checkpoint (the EAGLE repository's eagle/model/cnets.py `Model`, read at SafeAILab/EAGLE@148042c5; the keys and
config fields vLLM (vllm/model_executor/models/llama_eagle3.py), SGLang (python/sglang/srt/models/llama_eagle3.py)
and TensorRT-LLM (tensorrt_llm/_torch/models/modeling_speculative.py) read; commits in tests/test_eagle3.py):
    config.json   Llama fields (hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim,
                  rms_norm_eps, rope_theta, rope_scaling, num_hidden_layers: 1), vocab_size (the target's),
                  draft_vocab_size (K; absent: V), target_hidden_size (when present, the target's hidden_size),
                  architectures (LlamaForCausalLMEagle3 in the published heads; not required), bias (fc's),
                  attention_bias (q/k/v's), norm_before_residual, and the feature layers (below)
    model.safetensors or pytorch_model.bin:
                  fc.weight [H, 3H]; midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight,
                  midlayer.self_attn.{q,k,v}_proj.weight [*, 2H], midlayer.self_attn.o_proj.weight,
                  midlayer.mlp.{gate,up,down}_proj.weight; norm.weight; lm_head.weight [K, H]; d2t [K] int64 and
                  t2d [V] bool (`runtime.drafters.draft_vocab`); optionally embed_tokens.weight (else the target's
                  embedding). "layers.0." is read as "midlayer." (TensorRT-LLM and vLLM accept both); a head without
                  lm_head.weight (TensorRT-LLM and SGLang then take the target's) drafts with the target's lm_head.

Feature layers (`feature_layers`): the engines capture the residual stream entering layers (2, L // 2, L - 3) of an
L-layer target by default, concatenated in ascending layer order. A head may name others: vLLM reads the top-level
"eagle_aux_hidden_state_layer_ids" as those indices (the stream entering layer j); SGLang reads
"eagle_config": {"eagle_aux_hidden_state_layer_ids"} as the indices of the layers whose OUTPUT it takes (it adds 1),
TensorRT-LLM's eagle3_layers_to_capture (an engine setting, not the head's) likewise. Both spellings are read, each
in its engine's meaning, and must agree when both are given.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plugins.draft_layer import native as native_layer
from runtime.checkpoint import IGNORED_SUFFIXES, read_head_state
from runtime.config import ModelConfig
from runtime.draft_spec import DraftSpec, DynamicTreeOptions
from runtime.drafters.draft_vocab import DraftVocab
from runtime.drafters.eagle import (CONFIG_FILE, WEIGHT_FILES, EagleDrafter, EagleKind, _read_config,
                                   native_forward, native_layer_weights)
from runtime.errors import CheckpointError, ConfigError
from runtime.files import read_json_object
from runtime.kv_cache import KVCache
from runtime.model import (MLP, Attention, Int8Weight, PackedWeight, QuantizedWeight, RMSNorm, check_feature_layers,
                           linear)
from runtime.rope import RotaryEmbedding

NAME = "eagle3"
ARCHITECTURE = "LlamaForCausalLMEagle3"  # the published heads' config.json architectures entry
NUM_FEATURES = 3  # target layers an EAGLE-3 head reads (low, middle, high)
LAYER_PREFIX = "midlayer."  # the decoder layer's keys; "layers.0." is read as it
# the two spellings of a head's feature layers: vLLM's top-level key (layer inputs), SGLang's eagle_config key
# (layer outputs: one less than the layer whose input it is)
AUX_LAYERS_KEY = "eagle_aux_hidden_state_layer_ids"
EAGLE_CONFIG_KEY = "eagle_config"
# config switches of EAGLE-3 variants this loader does not run (each key: what it would need)
UNSUPPORTED = {
    "fc_norm": "an RMSNorm per feature before fc",
    "norm_before_fc": "an RMSNorm over the concatenated features before fc",
}
UNSUPPORTED_EAGLE_CONFIG = {
    "eh_proj_before_attn": "an embedding-hidden projection before attention",
    "use_aux_hidden_state": "a head without fc (false: it reads the last hidden state alone)",
}
_MAX_LISTED = 6


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """The layers whose input streams vLLM, SGLang and TensorRT-LLM capture for an EAGLE-3 head by default: 2,
    L // 2 and L - 3 of an L-layer target, ascending (vLLM's get_eagle3_aux_hidden_state_layers)."""
    return tuple(sorted({2, num_layers // 2, num_layers - 3}))


def feature_layers(raw: dict[str, Any], num_layers: int, where: str) -> tuple[int, ...]:
    """A head config's feature layers for a target of `num_layers` layers (module docstring), ascending;
    CheckpointError naming the field when they are malformed, disagree or do not fit the target."""
    eagle_config = raw.get(EAGLE_CONFIG_KEY) or {}
    if not isinstance(eagle_config, dict):
        raise CheckpointError(f"{where}: {EAGLE_CONFIG_KEY} must be a JSON object, got {eagle_config!r}")
    found: dict[str, tuple[int, ...]] = {}
    for key, ids, shift in ((AUX_LAYERS_KEY, raw.get(AUX_LAYERS_KEY), 0),
                            (f"{EAGLE_CONFIG_KEY}.{AUX_LAYERS_KEY}", eagle_config.get(AUX_LAYERS_KEY), 1)):
        if ids is None:
            continue
        if not isinstance(ids, list) or any(isinstance(j, bool) or not isinstance(j, int) for j in ids) or \
                len(set(ids)) != len(ids) or len(ids) != NUM_FEATURES:
            raise CheckpointError(f"{where}: {key}: got {ids!r}, expected {NUM_FEATURES} distinct layer indices")
        found[key] = tuple(sorted(j + shift for j in ids))
    if len(set(found.values())) > 1:
        (a, x), (b, y) = found.items()
        raise CheckpointError(f"{where}: {a} {list(x)} (layer inputs, vLLM's meaning) and {b} (layer outputs, "
                              f"SGLang's) name other layers: inputs {list(y)}")
    if found:
        key, layers = next(iter(found.items()))
    else:
        key, layers = f"{AUX_LAYERS_KEY} (absent: the default)", default_feature_layers(num_layers)
        if len(layers) != NUM_FEATURES or layers[0] < 0:
            raise CheckpointError(f"{where}: {AUX_LAYERS_KEY}: missing, and the default layers (2, L // 2, L - 3) "
                                  f"are not {NUM_FEATURES} distinct layers of this {num_layers}-layer target; name "
                                  f"the layers whose input streams the head reads")
    check_feature_layers(layers, num_layers, f"{where}: {key} (as layer inputs)", CheckpointError)
    return layers


class Eagle3Layer(nn.Module):
    """The "midlayer": attention over [input_layernorm(embedding); hidden_norm(feature)] (2H wide), the feature as
    its residual (or its norm, `norm_before_residual`), then the MLP block."""

    def __init__(self, config: ModelConfig, norm_before_residual: bool) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.self_attn = Attention(config, in_features=2 * h)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(config)
        self.rotary = RotaryEmbedding.from_config(config)
        self.norm_before_residual = norm_before_residual

    def forward(
        self,
        embeds: torch.Tensor,  # [B, N, H]: embeddings of x_{t+1}
        features: torch.Tensor,  # [B, N, H]: g_t (fc of the target's features, or a parent node's output)
        positions: torch.Tensor,  # [B, N] int64
        cache: Any,  # a KVCache (layer 0) or an AttendingCache
        tree_mask: torch.Tensor | None,  # [B, N, ceil(N / 32)] int32 packed (None under an AttendingCache)
    ) -> torch.Tensor:  # [B, N, H]: the layer's output o_t (before the head's norm)
        cos, sin = self.rotary(positions, features.dtype)
        h = self.hidden_norm(features)
        residual = h if self.norm_before_residual else features
        x = torch.cat([self.input_layernorm(embeds), h], dim=-1)  # [B, N, 2H]: the embedding FIRST
        x = residual + self.self_attn(x, cos, sin, cache, 0, tree_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(nn.Module):
    """fc, midlayer, norm, lm_head (+ embed_tokens): the published state-dict names. Drafts through
    `runtime.drafters.eagle`'s sessions, which read the head through the attributes EAGLE-1's head has."""

    fc_quantized: QuantizedWeight | None = None  # set by quantize()
    fc_packed: PackedWeight | None = None  # set by pack()
    # set by quantize(Int8Weight) where the midlayer runs as one native call (plugins/draft_layer)
    native: native_layer.EagleLayerWeights | None = None

    def __init__(self, config: ModelConfig, target_hidden: int, layers: tuple[int, ...], fc_bias: bool,
                 own_embedding: bool, lm_rows: int | None, norm_before_residual: bool,
                 vocab: DraftVocab | None = None) -> None:
        """lm_rows: the head's lm_head rows (its draft vocabulary); None: it drafts with the target's lm_head."""
        super().__init__()
        h = config.hidden_size
        self.config = config
        self.feature_layers = layers  # the target layers whose input streams fc reads, ascending
        self.vocab = vocab
        self.embed_tokens = nn.Embedding(config.vocab_size, h) if own_embedding else None
        self.fc = nn.Linear(len(layers) * target_hidden, h, bias=fc_bias)
        self.midlayer = Eagle3Layer(config, norm_before_residual)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = None if lm_rows is None else nn.Linear(h, lm_rows, bias=False)
        self.register_load_state_dict_post_hook(lambda module, _keys: module._drop_copies())

    def _drop_copies(self) -> None:
        self.fc_quantized = self.fc_packed = self.native = None

    def _apply(self, fn, recurse=True):
        self._drop_copies()
        return super()._apply(fn, recurse)

    def quantize(self, kind: type[QuantizedWeight]) -> None:
        """Run fc and the layer's matmuls on quantized copies (as `EagleHead.quantize`)."""
        self.fc_quantized = kind.of(self.fc.weight)
        self.midlayer.self_attn.quantize(kind)
        self.midlayer.mlp.quantize(kind)
        self.native = self._native_weights() if kind is Int8Weight else None

    def _native_weights(self) -> native_layer.EagleLayerWeights | None:
        """The midlayer's int8 copies as the native layer reads them; None where `native_layer_weights` refuses them
        (the torch route then runs)."""
        layer = self.midlayer
        return native_layer_weights(layer, input_norms=(layer.input_layernorm, layer.hidden_norm),
                                    norm_before_residual=layer.norm_before_residual)

    def pack(self) -> None:
        """Run fc and the layer's matmuls on oneDNN-packed copies (as `EagleHead.pack`)."""
        self.fc_packed = PackedWeight.of(self.fc.weight)
        self.midlayer.self_attn.pack()
        self.midlayer.mlp.pack()

    @property
    def fc_weight(self) -> torch.Tensor | QuantizedWeight | PackedWeight:
        if self.fc_quantized is not None:
            return self.fc_quantized
        return self.fc.weight if self.fc_packed is None else self.fc_packed

    def output_weight(self, model: Any) -> torch.Tensor:
        """The draft output layer # [K, H]: the head's lm_head, else the target's (rows of the draft vocabulary)."""
        if self.lm_head is not None:
            return self.lm_head.weight
        weight = model.lm_head_weight
        return weight if self.vocab is None else weight[self.vocab.target_ids.to(weight.device)].contiguous()

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features # [n, 3 * H_target] (ascending layers) -> g # [n, H]."""
        return linear(features, self.fc_weight, self.fc.bias)

    def new_cache(self, max_len: int) -> KVCache:
        c = self.config
        return KVCache(1, c.num_key_value_heads, c.head_dim, max_len, 1, self.fc.weight.dtype, self.fc.weight.device)

    @torch.no_grad()
    def forward(
        self,
        embeds: torch.Tensor,  # [1, N, H]
        features: torch.Tensor,  # [1, N, H]: g_t
        positions: torch.Tensor,  # [1, N] int64
        cache: Any,
        tree_mask: torch.Tensor | None,  # [1, N, ceil(N / 32)] int32 packed
    ) -> torch.Tensor:  # [1, N, H]: the layer's outputs o_t, the features of their children
        out = native_forward(self, embeds, features, positions, cache, tree_mask)
        return self.midlayer(embeds, features, positions, cache, tree_mask) if out is None else out


class Eagle3Drafter(EagleDrafter):
    """EAGLE-1's drafter (trees, sessions, pruning, quantization) over an `Eagle3Head`: the target's hidden-state rows
    it reads are [final-norm state, the feature layers' streams] (`runtime.model`), and its logits are
    lm_head(norm(o))."""

    name = NAME

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.head.feature_layers

    @property
    def input_width(self) -> int:
        return self.model.config.hidden_size * (1 + len(self.head.feature_layers))

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden # [n, H * (1 + 3)] -> g # [n, H]: fc over the three layers' streams (the final-norm state, the
        first H columns, is not read)."""
        return self.head.project(hidden[:, self.model.config.hidden_size:])

    def draft_logits(self, features: torch.Tensor) -> torch.Tensor:
        """The layer's outputs # [n, H] -> logits over the draft vocabulary # [n, K] float32."""
        return super().draft_logits(self.head.norm(features))


# ---- loading ----------------------------------------------------------------------------------------------------


def _flag(raw: dict[str, Any], key: str, where: str, default: bool = False) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise CheckpointError(f"{where}: {key} must be true or false, got {value!r}")
    return value


def _parse_config(raw: dict[str, Any], where: str, target: ModelConfig) -> ModelConfig:
    """The head layer's Llama shapes (its token ids and architecture are not read)."""
    if raw.get("num_hidden_layers", 1) != 1:
        raise CheckpointError(f"{where}: num_hidden_layers: got {raw['num_hidden_layers']!r}, expected 1 (a one-layer "
                              "EAGLE-3 head; heads with more layers are not supported)")
    try:
        parsed = ModelConfig.from_hf({**raw, "eos_token_id": None, "bos_token_id": None, "architectures": None,
                                      "model_type": "llama", "vocab_size": target.vocab_size,
                                      "num_hidden_layers": 1})
    except ConfigError as exc:
        raise CheckpointError(f"{where}: {exc}") from exc
    return dataclasses.replace(parsed, attention_bias=_flag(raw, "attention_bias", where), o_proj_bias=False,
                               mlp_bias=_flag(raw, "mlp_bias", where), dtype=target.dtype)


def _check_variant(raw: dict[str, Any], where: str) -> None:
    for key, what in UNSUPPORTED.items():
        if raw.get(key):
            raise CheckpointError(f"{where}: {key}: got {raw[key]!r}; this loader runs the published EAGLE-3 head, "
                                  f"without {what}")
    eagle_config = raw.get(EAGLE_CONFIG_KEY) or {}
    for key, what in UNSUPPORTED_EAGLE_CONFIG.items():
        if key in eagle_config and eagle_config[key] != (key == "use_aux_hidden_state"):
            raise CheckpointError(f"{where}: {EAGLE_CONFIG_KEY}.{key}: got {eagle_config[key]!r}; this loader runs the "
                                  f"published EAGLE-3 head, not {what}")


def load_eagle3_head(path: str | Path, model: Any) -> Eagle3Head:
    """Load an EAGLE-3 head directory (public layout) for `model` (a TargetModel): validated, cast to its dtype and
    device."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"EAGLE-3 head path {path} is not a directory")
    target: ModelConfig = model.config
    where = str(path / CONFIG_FILE)
    raw = _read_config(path, target)
    _check_variant(raw, where)
    if raw.get("target_hidden_size", target.hidden_size) != target.hidden_size:
        raise CheckpointError(f"{where}: target_hidden_size {raw['target_hidden_size']!r} does not match the target "
                              f"model's hidden_size {target.hidden_size}")
    layers = feature_layers(raw, target.num_hidden_layers, where)
    config = _parse_config(raw, where, target)
    file, state = read_head_state(path, WEIGHT_FILES, Eagle3Kind.title)
    state = {(LAYER_PREFIX + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in state.items()
             if not k.endswith(IGNORED_SUFFIXES)}
    vocab = DraftVocab.from_state(state, target.vocab_size, file)
    if vocab is not None and vocab.size == target.vocab_size:
        vocab = None  # d2t all zeros: the draft vocabulary is the target's
    k = target.vocab_size if vocab is None else vocab.size
    if raw.get("draft_vocab_size", k) not in (k, None):
        raise CheckpointError(f"{where}: draft_vocab_size {raw['draft_vocab_size']!r} but d2t in {file} maps "
                              f"{k} draft tokens")
    if "fc.weight" not in state:
        raise CheckpointError(f"{file} has no fc.weight: not an EAGLE-3 head (keys: {sorted(state)[:_MAX_LISTED]})")
    fc_in = NUM_FEATURES * target.hidden_size
    if tuple(state["fc.weight"].shape) != (config.hidden_size, fc_in):
        raise CheckpointError(f"{file}: fc.weight has shape {tuple(state['fc.weight'].shape)}, expected "
                              f"[{config.hidden_size}, {fc_in}] (hidden_size x {NUM_FEATURES} target layers of "
                              f"{target.hidden_size})")
    lm = state.get("lm_head.weight")
    if lm is not None and lm.shape[0] != k:
        raise CheckpointError(f"{file}: lm_head.weight has {lm.shape[0]} rows, expected {k} (draft_vocab_size)")
    if lm is None and config.hidden_size != target.hidden_size:
        raise CheckpointError(f"{file} has no lm_head.weight, and the target's lm_head reads {target.hidden_size} "
                              f"features, not this head's {config.hidden_size}")
    with torch.device("meta"):
        head = Eagle3Head(config, target.hidden_size, layers, _flag(raw, "bias", where),
                          own_embedding="embed_tokens.weight" in state, lm_rows=None if lm is None else k,
                          norm_before_residual=_flag(raw, "norm_before_residual", where), vocab=vocab)
    expected = {key: tuple(v.shape) for key, v in head.state_dict().items()}
    missing, extra = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
    if missing or extra:
        parts = ([f"missing {len(missing)} key(s) {missing[:_MAX_LISTED]}"] if missing else []) + \
                ([f"unexpected {len(extra)} key(s) {extra[:_MAX_LISTED]}"] if extra else [])
        raise CheckpointError(f"{file} does not match an EAGLE-3 head of its config (bias={head.fc.bias is not None}, "
                              f"attention_bias={config.attention_bias}): " + "; ".join(parts))
    for key, shape in expected.items():
        if tuple(state[key].shape) != shape:
            raise CheckpointError(f"{file}: {key} has shape {tuple(state[key].shape)}, expected {shape} from "
                                  f"{CONFIG_FILE}")
        if not state[key].is_floating_point():
            raise CheckpointError(f"{file}: {key} has dtype {state[key].dtype}, expected floating point")
    head.load_state_dict({key: v.to(device=model.device, dtype=model.dtype) for key, v in state.items()},
                         strict=True, assign=True)
    head.to(model.device)  # the RoPE buffers (built on the CPU even under the meta device) follow the weights
    head.requires_grad_(False)
    head.eval()
    return head


class Eagle3Kind(EagleKind):
    name = NAME
    title = "EAGLE-3"

    def load(self, spec: DraftSpec, model: Any) -> Eagle3Drafter:
        """Without a static tree: the dynamic tree, with spec.dynamic or the default options."""
        static = spec.static_tree
        dynamic = None if static is not None else spec.dynamic if spec.dynamic is not None else DynamicTreeOptions()
        return Eagle3Drafter(load_eagle3_head(spec.path, model), model, tree=static, dynamic=dynamic,
                             quantization=spec.quantization, pruning=spec.pruning)

    def recognizes(self, directory: Path) -> bool:
        """The published layout: a config.json naming LlamaForCausalLMEagle3 or a draft_vocab_size beside a head
        whose weights have midlayer.* keys or a [H, 3H] fc (the weights are read only for the last two)."""
        cfg = directory / CONFIG_FILE
        if not cfg.is_file():
            return False
        raw = read_json_object(cfg, CheckpointError)
        if ARCHITECTURE in (raw.get("architectures") or ()):
            return True
        if not any((directory / name).is_file() for name in WEIGHT_FILES):
            return False
        try:
            _, state = read_head_state(directory, WEIGHT_FILES, self.title)
        except CheckpointError:
            return False
        fc = state.get("fc.weight")
        return any(k.startswith(LAYER_PREFIX) for k in state) or (
            fc is not None and fc.ndim == 2 and fc.shape[1] == NUM_FEATURES * fc.shape[0])


KIND = Eagle3Kind()

__all__ = ["ARCHITECTURE", "KIND", "NAME", "NUM_FEATURES", "Eagle3Drafter", "Eagle3Head", "Eagle3Kind", "Eagle3Layer",
           "default_feature_layers", "feature_layers", "load_eagle3_head"]
