"""ModelConfig: the target model's architecture, read from a Hugging Face config.json.

Both config formats on the hub are accepted: the older one (top-level `rope_theta`, `rope_scaling`,
`torch_dtype`) and transformers >= 5's (`rope_parameters` holding rope_theta and the scaling, `dtype`).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from plugins import cpu
from plugins.stream_linear import native as stream_linear
from runtime import schema
from runtime.errors import ConfigError
from runtime.files import read_json_object
from runtime.schema import setting

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
AUTO = "auto"  # the dtype this machine runs best without changing what the model says (`choose_dtype`)
DTYPE_CHOICES = (*DTYPES, AUTO)  # what a user may ask for (configs, CLIs, runtime.load)


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling; `rope_type` is "linear" or "llama3" (the plain RoPE is `rope_scaling=None`)."""

    rope_type: str
    factor: float
    # llama3 only:
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int = setting(ge=1)
    hidden_size: int = setting(ge=1)
    intermediate_size: int = setting(ge=1)
    num_hidden_layers: int = setting(ge=1)
    num_attention_heads: int = setting(ge=1)
    num_key_value_heads: int = setting(ge=1)
    head_dim: int = setting(ge=1)
    max_position_embeddings: int = setting(ge=1)
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    attention_bias: bool  # bias on q/k/v projections
    o_proj_bias: bool  # bias on the attention output projection (Llama's attention_bias covers it; Qwen2's not)
    mlp_bias: bool
    tie_word_embeddings: bool
    dtype: str  # "float32" | "bfloat16" | "float16"
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    max_context: int = setting(ge=1)  # longest sequence (prompt + generated) this implementation computes exactly
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        schema.check(self, ConfigError)
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            raise ConfigError(f"rms_norm_eps must be a positive number, got {self.rms_norm_eps!r}")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ConfigError(f"rope_theta must be a positive number, got {self.rope_theta!r}")
        for tid in (*self.eos_token_ids, *(() if self.bos_token_id is None else (self.bos_token_id,))):
            if not 0 <= tid < self.vocab_size:
                raise ConfigError(f"special token id {tid} is outside the vocabulary [0, {self.vocab_size})")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def with_dtype(self, dtype: str | torch.dtype | None) -> ModelConfig:
        """A copy running in `dtype` (None keeps the config's)."""
        if dtype is None:
            return self
        return dataclasses.replace(self, dtype=dtype_name(dtype))

    @classmethod
    def from_hf(cls, path_or_dict: str | Path | dict[str, Any]) -> ModelConfig:
        """From a checkpoint directory, a config.json path, or the parsed config.json dict.

        A directory's generation_config.json is read too: its eos_token_id (int or list, as in Llama 3) is
        merged with config.json's.
        """
        generation: dict[str, Any] = {}
        if isinstance(path_or_dict, dict):
            raw = path_or_dict
            source = "config"
        else:
            path = Path(path_or_dict)
            if path.is_dir():
                config_path = path / "config.json"
                gen_path = path / "generation_config.json"
            else:
                config_path, gen_path = path, path.parent / "generation_config.json"
            if not config_path.is_file():
                raise ConfigError(f"missing config.json: {config_path} does not exist")
            raw = read_json_object(config_path, ConfigError)
            source = str(config_path)
            if gen_path.is_file():
                generation = read_json_object(gen_path, ConfigError)
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        return _parse(raw, generation, source)


def dtype_name(dtype: str | torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16, 'bf16' or 'bfloat16'; ConfigError for anything unsupported."""
    if isinstance(dtype, torch.dtype):
        for name, value in DTYPES.items():
            if value == dtype:
                return name
        raise ConfigError(f"unsupported dtype {dtype}; expected one of {', '.join(DTYPES)}")
    if isinstance(dtype, str):
        name = _DTYPE_ALIASES.get(dtype, dtype).removeprefix("torch.")
        if name in DTYPES:
            return name
    raise ConfigError(f"unsupported dtype {dtype!r}; expected one of {', '.join(DTYPES)}")


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a model runs in, what was asked for and why (recorded in engine.json, shown by build and setup)."""

    dtype: str  # a key of DTYPES
    requested: str | None  # a DTYPE_CHOICES name; None: the checkpoint's own
    reason: str  # one line
    demoted: bool = False  # a default (the checkpoint's bfloat16) that this CPU runs as float32 instead

    def warn_if_demoted(self, source: str) -> None:
        """One line (a RuntimeWarning) where a default dtype was demoted: the user should know why it is float32."""
        if self.demoted:
            warnings.warn(f"{source}: {self.reason} (dtype 'auto' chooses so without this warning)", RuntimeWarning,
                          stacklevel=3)


TARGET_QUANTIZATIONS = tuple(stream_linear.QUANT_FORMATS)  # TargetModel.quantize_weights kinds: "q8", "q4"


def choose_dtype(requested: str | torch.dtype | None, stored: str | torch.dtype,
                 device: torch.device | str = "cpu", runs_here: bool = True) -> DtypeChoice:
    """The dtype to run a model stored in `stored` on `device`, as `requested`:

    - "auto": on a CPU, bfloat16 where its weights run fast (plugins/stream_linear `bf16_missing`: the weight-streaming
      kernel builds, or the CPU multiplies bf16 in hardware), float32 elsewhere; on CUDA bfloat16 where the GPU has it,
      else float16; float32 on other devices.
      (A bfloat16 CPU model also checks its matmuls' row invariance when it loads and runs in float32 where that
      fails: runtime/model.py.)
    - None: `stored`, except a bfloat16 checkpoint on a CPU where bf16 cannot run fast, which runs in float32: its
      values exactly, at float32's speed instead of emulated bf16 matmuls' (~10-20x slower).
    - a dtype: as asked; bfloat16 on a CPU where it cannot run fast is refused (ConfigError saying why).
    runs_here=False (a conversion, such as a build, whose weights run elsewhere): a dtype and None are taken as they
    are; "auto" still chooses for this machine.
    """
    device = torch.device(device)
    on_cpu = device.type == "cpu"
    missing = stream_linear.bf16_missing() if on_cpu else None
    stored = dtype_name(stored)
    if requested == AUTO:
        if on_cpu:
            return DtypeChoice("float32" if missing else "bfloat16", AUTO,
                               f"auto: {missing or stream_linear.bf16_route()}")
        if device.type == "cuda":
            if torch.cuda.is_bf16_supported():
                return DtypeChoice("bfloat16", AUTO, "auto: the GPU has bf16")
            return DtypeChoice("float16", AUTO, "auto: the GPU has no bf16")
        return DtypeChoice("float32", AUTO, f"auto: float32 on {device.type}")
    if requested is None:
        if runs_here and on_cpu and stored == "bfloat16" and missing:
            return DtypeChoice("float32", None, f"the checkpoint's bfloat16 runs as float32: {missing}",
                               demoted=True)
        return DtypeChoice(stored, None, "the checkpoint's dtype")
    name = dtype_name(requested)
    if runs_here and on_cpu and name == "bfloat16" and missing:
        raise ConfigError(
            f"dtype 'bfloat16' needs a CPU that multiplies bf16 natively or the weight-streaming kernel, and "
            f"{missing}: its bf16 matmuls would be emulated, ~10-20x slower than float32; expected dtype {AUTO!r} or "
            "'float32'"
        )
    return DtypeChoice(name, name, "as asked")


def token_id_list(value: Any, field: str) -> list[int]:
    """An HF token-id field (None, int, or list of ints) as a list; ConfigError on anything else."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"{field} must be a non-negative int or a list of them, got {value!r}")
    return list(values)


def _architecture(raw: dict[str, Any], source: str) -> str:
    archs = raw.get("architectures")
    if archs:
        if not isinstance(archs, list) or len(archs) != 1:
            raise ConfigError(f"{source}: expected exactly one entry in 'architectures', got {archs!r}")
        return archs[0]
    model_type = raw.get("model_type")
    if model_type in _MODEL_TYPE_TO_ARCH:
        return _MODEL_TYPE_TO_ARCH[model_type]
    raise ConfigError(
        f"{source}: unknown architecture (architectures missing, model_type {model_type!r}); "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _rope(raw: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from either config format."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: rope_scaling / rope_parameters must be an object, got {params!r}")
    if params and all(isinstance(v, dict) or v is None for v in params.values()):
        raise ConfigError(f"{source}: per-layer-type rope_parameters are not supported: {params!r}")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise ConfigError(f"{source}: rope_theta must be a number, got {theta!r}")
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ConfigError(f"{source}: partial_rotary_factor {partial!r} is not supported (expected 1.0)")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"{source}: unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return float(theta), None

    def number(key: str, default: Any = None) -> float:
        value = params.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"{source}: rope scaling {rope_type!r} needs a positive number {key}, got {value!r}")
        return float(value)

    factor = number("factor")
    if rope_type == "linear":
        return float(theta), RopeScaling("linear", factor)
    low, high = number("low_freq_factor"), number("high_freq_factor")
    if high <= low:
        raise ConfigError(f"{source}: llama3 rope needs high_freq_factor > low_freq_factor, got {high} <= {low}")
    original = params.get("original_max_position_embeddings", raw.get("max_position_embeddings"))
    if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
        raise ConfigError(
            f"{source}: llama3 rope needs a positive int original_max_position_embeddings, got {original!r}"
        )
    return float(theta), RopeScaling("llama3", factor, low, high, original)


def _number(value: Any, name: str, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{source}: {name} must be a number, got {value!r}")
    return float(value)


def _parse(raw: dict[str, Any], generation: dict[str, Any], source: str) -> ModelConfig:
    arch = _architecture(raw, source)
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise ConfigError(f"{source}: unsupported architecture {arch!r}; supported: {supported}")

    def field(name: str, default: Any = None) -> Any:
        value = raw.get(name, default)
        if value is None:
            raise ConfigError(f"{source}: missing required field {name!r}")
        return value

    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{source}: hidden_act {act!r} is not supported (expected 'silu')")
    hidden = field("hidden_size")
    heads = field("num_attention_heads")
    head_dim = raw.get("head_dim")
    if head_dim is None:
        if not isinstance(hidden, int) or not isinstance(heads, int) or heads <= 0 or hidden % heads:
            raise ConfigError(f"{source}: hidden_size {hidden!r} is not divisible by num_attention_heads {heads!r}")
        head_dim = hidden // heads
    theta, scaling = _rope(raw, source)

    if arch == "Qwen2ForCausalLM":
        attention_bias, o_proj_bias = True, False  # fixed by the architecture, not in config.json
    else:
        attention_bias = bool(raw.get("attention_bias", False))
        o_proj_bias = attention_bias

    # Sliding-window attention equals full attention while the sequence fits in the window, so the window
    # caps the context instead of being implemented. Qwen2 only slides when use_sliding_window is set.
    window = raw.get("sliding_window")
    if arch == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
        window = None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise ConfigError(f"{source}: sliding_window must be a positive int or null, got {window!r}")
    max_pos = field("max_position_embeddings")
    max_context = min(max_pos, window) if window is not None and isinstance(max_pos, int) else max_pos

    dtype = raw.get("dtype", raw.get("torch_dtype")) or "float32"
    eos: list[int] = []
    for value, name in (
        (generation.get("eos_token_id"), "generation_config.json eos_token_id"),
        (raw.get("eos_token_id"), f"{source} eos_token_id"),
    ):
        eos += [t for t in token_id_list(value, name) if t not in eos]
    bos = token_id_list(generation.get("bos_token_id", raw.get("bos_token_id")), "bos_token_id")

    return ModelConfig(
        architecture=arch,
        vocab_size=field("vocab_size"),
        hidden_size=hidden,
        intermediate_size=field("intermediate_size"),
        num_hidden_layers=field("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rms_norm_eps=_number(field("rms_norm_eps", 1e-6), "rms_norm_eps", source),
        rope_theta=theta,
        rope_scaling=scaling,
        attention_bias=attention_bias,
        o_proj_bias=o_proj_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        dtype=dtype_name(dtype),
        bos_token_id=bos[0] if bos else None,
        eos_token_ids=tuple(eos),
        max_context=max_context,
        sliding_window=window,
    )


__all__ = ["AUTO", "DTYPES", "DTYPE_CHOICES", "DtypeChoice", "ModelConfig", "RopeScaling", "SUPPORTED_ARCHITECTURES",
           "SUPPORTED_ROPE_TYPES", "choose_dtype", "dtype_name"]
