"""Tiny random draft heads in the PUBLIC on-disk formats, for tests.

    write_medusa_head(dir, hidden_size, vocab_size, ...)   FasterDecoding Medusa-1: config.json +
                                                           medusa_lm_head.safetensors or medusa_lm_head.pt
    write_eagle_head(dir, target_dir, ...)                 SafeAILab EAGLE-1: config.json (Llama-style, one
                                                           layer) + pytorch_model.bin or model.safetensors
    write_eagle_config(path, target_dir, heads, ...)       a builder YAML drafting target_dir with that EAGLE head
    Eagle3Reference(cfg, draft_vocab)                      the EAGLE-3 head's published module structure (SafeAILab
                                                           EAGLE eagle/model/cnets.py `Model`), our own reference
    write_eagle3_head(dir, target_dir, ...)                its state dict in the public layout: config.json
                                                           (LlamaForCausalLMEagle3) + model.safetensors / .bin
    draft_paths(draft)                                     every node of a drafted tree as its token path

The Medusa state dict is produced by the FasterDecoding module structure itself (nn.ModuleList of
nn.Sequential(ResBlock..., Linear)); the EAGLE layer weights by transformers' LlamaDecoderLayer, so the key
names are the real ones, not our own spelling of them. transformers is imported lazily.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

StateHook = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


class ResBlock(nn.Module):
    """FasterDecoding's ResBlock: x + SiLU(Linear(x))."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


def medusa_module(hidden_size: int, vocab_size: int, num_heads: int, num_layers: int) -> nn.ModuleList:
    """The FasterDecoding `medusa_head` module list (independent layers per head)."""
    return nn.ModuleList(
        nn.Sequential(
            *[ResBlock(hidden_size) for _ in range(num_layers)], nn.Linear(hidden_size, vocab_size, bias=False)
        )
        for _ in range(num_heads)
    )


def _randomize(module: nn.Module, seed: int, scale: float = 0.2) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(scale * noise)


def write_medusa_head(
    dir: str | Path,
    hidden_size: int,
    vocab_size: int,
    num_heads: int = 4,
    num_layers: int = 1,
    fmt: str = "safetensors",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    config_overrides: dict[str, Any] | None = None,
    state_hook: StateHook | None = None,
) -> Path:
    """Write a random Medusa-1 head directory; returns it. fmt: "safetensors" | "pt".

    config_overrides update config.json (a None value removes the key); state_hook edits the state dict before
    it is written (to make broken checkpoints for error tests).
    """
    if fmt not in ("safetensors", "pt"):
        raise ValueError(f"fmt must be 'safetensors' or 'pt', got {fmt!r}")
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    heads = medusa_module(hidden_size, vocab_size, num_heads, num_layers)
    _randomize(heads, seed)
    state = {k: v.to(dtype).contiguous() for k, v in heads.state_dict().items()}
    if state_hook is not None:
        state = state_hook(state)
    config: dict[str, Any] = {
        "medusa_num_heads": num_heads,
        "medusa_num_layers": num_layers,
        "base_model_name_or_path": "tiny-target",
        "hidden_size": hidden_size,
        "vocab_size": vocab_size,
        "transformers_version": "4.34.0",
    }
    return _write_head(out, config, config_overrides, state,
                       "medusa_lm_head.safetensors" if fmt == "safetensors" else "medusa_lm_head.pt")


def load_medusa_reference(dir: str | Path) -> nn.ModuleList:
    """Load a head directory into the FasterDecoding module structure (strict), for reference outputs."""
    from safetensors.torch import load_file

    d = Path(dir)
    cfg = json.loads((d / "config.json").read_text())
    st = d / "medusa_lm_head.safetensors"
    state = load_file(str(st)) if st.exists() else torch.load(d / "medusa_lm_head.pt", weights_only=True)
    lm = state[f"0.{cfg['medusa_num_layers']}.weight"]
    module = medusa_module(lm.shape[1], lm.shape[0], cfg["medusa_num_heads"], cfg["medusa_num_layers"])
    module.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return module


def eagle_layer_config(target_dir: str | Path, **overrides: Any):
    """transformers LlamaConfig of an EAGLE head for the target at target_dir (one layer, same shapes)."""
    from transformers import LlamaConfig

    t = json.loads((Path(target_dir) / "config.json").read_text())
    rope = t.get("rope_parameters") or {}
    kw: dict[str, Any] = dict(
        vocab_size=t["vocab_size"],
        hidden_size=t["hidden_size"],
        intermediate_size=t["intermediate_size"],
        num_hidden_layers=1,
        num_attention_heads=t["num_attention_heads"],
        num_key_value_heads=t.get("num_key_value_heads", t["num_attention_heads"]),
        head_dim=t["hidden_size"] // t["num_attention_heads"],  # EAGLE's attention: hidden_size // heads
        max_position_embeddings=t["max_position_embeddings"],
        rms_norm_eps=t["rms_norm_eps"],
        rope_theta=rope.get("rope_theta", t.get("rope_theta", 10000.0)),
        attention_bias=False,
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    cfg = LlamaConfig(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def _write_head(out: Path, config: dict[str, Any], overrides: dict[str, Any] | None, state: dict[str, torch.Tensor],
                weights: str) -> Path:
    """config.json (`overrides` set, None: removed) and the weights as file `weights` (safetensors for a .safetensors
    name, else torch.save) into `out`; returns it."""
    for key, v in (overrides or {}).items():
        if v is None:
            config.pop(key, None)
        else:
            config[key] = v
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    if weights.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file(state, str(out / weights))
    else:
        torch.save(state, out / weights)
    return out


def _eagle_weights(fmt: str) -> str:
    return "pytorch_model.bin" if fmt == "bin" else "model.safetensors"


def write_eagle_head(
    dir: str | Path,
    target_dir: str | Path,
    fmt: str = "bin",
    seed: int = 0,
    with_embedding: bool = False,
    fc_bias: bool = True,
    num_layers: int = 1,
    config_overrides: dict[str, Any] | None = None,
    state_hook: StateHook | None = None,
) -> Path:
    """Write a random EAGLE-1 head for the target checkpoint at target_dir; returns the directory.

    fmt: "bin" (pytorch_model.bin, what the EAGLE repo ships) | "safetensors" (model.safetensors).
    with_embedding: include embed_tokens.weight (a perturbed copy of the target's, so using the wrong
    embedding changes the drafts). fc_bias: the config's "bias" flag and the fc.bias tensor.
    Layer weights come from transformers' LlamaDecoderLayer (layer 0 without input_layernorm, as in EAGLE).
    """
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    if fmt not in ("bin", "safetensors"):
        raise ValueError(f"fmt must be 'bin' or 'safetensors', got {fmt!r}")
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = eagle_layer_config(target_dir, num_hidden_layers=num_layers)
    h = cfg.hidden_size
    state: dict[str, torch.Tensor] = {}
    for i in range(num_layers):
        layer = LlamaDecoderLayer(cfg, i)
        _randomize(layer, seed + 100 * i, scale=0.15)
        for k, v in layer.state_dict().items():
            if i == 0 and k.startswith("input_layernorm."):
                continue  # EAGLE-1: no input norm in layer 0
            state[f"layers.{i}.{k}"] = v.contiguous()
    fc = nn.Linear(2 * h, h, bias=fc_bias)
    _randomize(fc, seed + 7, scale=0.1)
    state["fc.weight"] = fc.weight.detach().contiguous()
    if fc_bias:
        state["fc.bias"] = fc.bias.detach().contiguous()
    if with_embedding:
        from safetensors.torch import load_file

        target = load_file(str(Path(target_dir) / "model.safetensors"))
        emb = target["model.embed_tokens.weight"].float()
        gen = torch.Generator().manual_seed(seed + 11)
        state["embed_tokens.weight"] = (emb + 0.5 * torch.randn(emb.shape, generator=gen)).contiguous()
    if state_hook is not None:
        state = state_hook(state)
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "bias": fc_bias,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "hidden_act": "silu",
        "hidden_size": h,
        "initializer_range": 0.02,
        "intermediate_size": cfg.intermediate_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "model_type": "llama",
        "num_attention_heads": cfg.num_attention_heads,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": cfg.num_key_value_heads,
        "pad_token_id": 0,
        "pretraining_tp": 1,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None) else cfg.rope_theta,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "transformers_version": "4.28.1",
        "use_cache": True,
        "vocab_size": cfg.vocab_size,
    }
    return _write_head(out, config, config_overrides, state, _eagle_weights(fmt))


class Eagle3Attention(nn.Module):
    """cnets.py LlamaAttention of the EAGLE-3 layer: q/k/v read 2H features (the embedding, then the feature)."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(2 * h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.num_kv * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.num_kv * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)


class Eagle3Layer(nn.Module):
    """cnets.py LlamaDecoderLayeremb: hidden_norm, input_layernorm, self_attn, post_attention_layernorm, mlp."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

        self.self_attn = Eagle3Attention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.hidden_norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)


class Eagle3Reference(nn.Module):
    """The EAGLE-3 head as SafeAILab/EAGLE's eagle/model/cnets.py `Model` is built (read at
    SafeAILab/EAGLE@148042c5fed07822194a49b027c897c9c5494b0e): fc Linear(3H -> H, no bias), midlayer, norm,
    lm_head Linear(H -> draft_vocab_size), d2t / t2d buffers; the embedding is the target's. Its state-dict names are
    the published ones. `forward` is written from that file's forward: a causal pass over a whole sequence (no cache),
    fc applied to features wider than H, RoPE from transformers' Llama rotary embedding."""

    def __init__(self, cfg: Any, draft_vocab_size: int) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        h = cfg.hidden_size
        self.cfg = cfg
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.rotary = LlamaRotaryEmbedding(cfg)

    def forward(
        self,
        features: torch.Tensor,  # [T, 3H] target features or [T, H] the head's own outputs (per row, see `mixed`)
        embeds: torch.Tensor,  # [T, H] the target's embeddings of the paired tokens
        positions: torch.Tensor,  # [T] int64
    ) -> torch.Tensor:  # [T, H] the layer's outputs (before norm)
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        g = self.fc(features) if features.shape[-1] != embeds.shape[-1] else features
        return self._layer(g, embeds, positions, apply_rotary_pos_emb)

    def mixed(self, rows: list[torch.Tensor], embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """forward over rows that are each a target feature [3H] (fc applied) or a head output [H] (used as is)."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        h = self.cfg.hidden_size
        g = torch.stack([self.fc(r) if r.shape[-1] != h else r for r in rows])
        return self._layer(g, embeds, positions, apply_rotary_pos_emb)

    def _layer(self, g: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor, rope) -> torch.Tensor:
        m, a = self.midlayer, self.midlayer.self_attn
        t = g.shape[0]
        x = torch.cat([m.input_layernorm(embeds), m.hidden_norm(g)], dim=-1)[None]  # [1, T, 2H]
        q = a.q_proj(x).view(1, t, a.num_heads, a.head_dim).transpose(1, 2)
        k = a.k_proj(x).view(1, t, a.num_kv, a.head_dim).transpose(1, 2)
        v = a.v_proj(x).view(1, t, a.num_kv, a.head_dim).transpose(1, 2)
        cos, sin = self.rotary(x, positions[None])
        q, k = rope(q, k, cos, sin)
        rep = a.num_heads // a.num_kv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = q @ k.transpose(2, 3) / a.head_dim**0.5
        scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(1, t, -1)
        h = g[None] + a.o_proj(out)  # the residual is the feature itself
        return (h + m.mlp(m.post_attention_layernorm(h)))[0]

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """The layer's outputs # [..., H] -> logits over the draft vocabulary # [..., K]."""
        return self.lm_head(self.norm(out))

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


def eagle3_layer_config(target_dir: str | Path):
    """transformers LlamaConfig of an EAGLE-3 head for the target at target_dir: one layer, the target's shapes and
    RoPE (its scaling too)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig.from_pretrained(str(target_dir), num_hidden_layers=1, tie_word_embeddings=False,
                                      attention_bias=False)
    cfg._attn_implementation = "eager"
    return cfg


def _rope_fields(cfg: Any) -> dict[str, Any]:
    """rope_theta and rope_scaling as a published head's config.json spells them (transformers 4's keys)."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    theta = params.pop("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    return {"rope_theta": theta, "rope_scaling": params if params.get("rope_type", "default") != "default" else None}


def write_eagle3_head(
    dir: str | Path,
    target_dir: str | Path,
    fmt: str = "safetensors",
    seed: int = 0,
    vocab: Any = None,
    layer_prefix: str = "midlayer.",
    with_embedding: bool = False,
    config_overrides: dict[str, Any] | None = None,
    state_hook: StateHook | None = None,
) -> Path:
    """Write a random EAGLE-3 head (`Eagle3Reference`'s state dict) for the target at target_dir; returns the
    directory. vocab: a runtime.drafters.draft_vocab.DraftVocab (its K tokens; None: the whole vocabulary, d2t all
    zeros, t2d all true, as the EAGLE repository writes a full one). layer_prefix "layers.0." writes the layer's keys
    as TensorRT-LLM / vLLM also accept them. config_overrides: keys set (None: removed)."""
    if fmt not in ("bin", "safetensors"):
        raise ValueError(f"fmt must be 'bin' or 'safetensors', got {fmt!r}")
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = eagle3_layer_config(target_dir)
    k = cfg.vocab_size if vocab is None else vocab.size
    head = Eagle3Reference(cfg, k)
    _randomize(head, seed, scale=0.15)
    state = {(layer_prefix + n[len("midlayer."):] if n.startswith("midlayer.") else n): v.detach().contiguous()
             for n, v in head.state_dict().items() if not n.startswith("rotary.")}
    if vocab is None:
        state["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    else:
        state.update(vocab.state())
    if with_embedding:
        from safetensors.torch import load_file

        emb = load_file(str(Path(target_dir) / "model.safetensors"))["model.embed_tokens.weight"].float()
        gen = torch.Generator().manual_seed(seed + 11)
        state["embed_tokens.weight"] = (emb + 0.5 * torch.randn(emb.shape, generator=gen)).contiguous()
    if state_hook is not None:
        state = state_hook(state)
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "bos_token_id": 0,
        "eos_token_id": 1,
        "hidden_act": "silu",
        "hidden_size": cfg.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": cfg.intermediate_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "model_type": "llama",
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "pad_token_id": 0,
        "rms_norm_eps": cfg.rms_norm_eps,
        **_rope_fields(cfg),
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "transformers_version": "4.28.1",
        "use_cache": True,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": k,
    }
    return _write_head(out, config, config_overrides, state, _eagle_weights(fmt))


def load_eagle3_reference(dir: str | Path, target_dir: str | Path) -> Eagle3Reference:
    """The `Eagle3Reference` of a head `write_eagle3_head` wrote (float32)."""
    from runtime.checkpoint import read_head_state

    cfg = eagle3_layer_config(target_dir)
    _, state = read_head_state(Path(dir), ("model.safetensors", "pytorch_model.bin"), "EAGLE-3")
    state = {("midlayer." + n[len("layers.0."):] if n.startswith("layers.0.") else n): v for n, v in state.items()}
    head = Eagle3Reference(cfg, state["lm_head.weight"].shape[0])
    head.load_state_dict({n: (v if n in ("d2t", "t2d") else v.float()) for n, v in state.items()}, strict=False)
    return head.eval()


def write_eagle_config(
    path: str | Path,
    target_dir: str | Path,
    heads: str | Path,
    draft: dict[str, Any] | None = None,
    build: dict[str, Any] | None = None,
) -> Path:
    """Write a builder YAML at `path` for the target at target_dir drafted by the EAGLE head directory `heads`: the
    tree preset chain-2, a float32 engine in `engine/` beside the YAML, no ONNX; `draft` / `build` add or replace keys
    of those sections. Returns the path."""
    import yaml

    out = Path(path)
    data = {
        "model": {"checkpoint": str(target_dir)},
        "draft": {"method": "eagle", "checkpoint": str(heads), "tree": {"preset": "chain-2"}, **(draft or {})},
        "build": {"dtype": "float32", "output": str(out.parent / "engine"), "onnx": False, **(build or {})},
    }
    out.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return out


def draft_paths(draft: Any) -> set[tuple[int, ...]]:
    """Every node of a `runtime.protocol.Draft` as its token path from the root (root excluded)."""
    toks, parents, out = draft.tokens.tolist(), draft.tree.parent_list, set()
    for node in range(1, draft.tree.num_nodes):
        path, n = [], node
        while n:
            path.append(toks[n])
            n = parents[n]
        out.add(tuple(reversed(path)))
    return out
