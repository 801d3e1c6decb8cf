"""The `transformers` baselines: greedy `generate` of the reference implementation on the same weights, plain or
with one of transformers' own speculative options.

transformers is imported lazily (the runtime never imports it; perf uses it only for this baseline). The model
is the target the benchmark's runtime decoders use:
    an HF checkpoint directory   AutoModelForCausalLM.from_pretrained(dir) in the same dtype;
    an engine directory          the model built from the engine's config.json with the weights re-assembled
                                 from its TensorRT-LLM checkpoint (`runtime.engine.target_from_trtllm`), i.e.
                                 exactly the weights the runtime serves.
Generation is greedy with EOS disabled (`eos_token_id=[]`), so it runs for exactly `max_new_tokens`, as the
runtime does with `ignore_eos`. Every target forward is counted with a forward pre-hook on the target (an
assistant model's forwards are its own module's, so they are not counted).

One class, one `generate`; an instance fixes the extra `generate` keyword arguments it passes:
    hf            none: greedy decoding, one target forward per token
    hf-lookup     prompt_lookup_num_tokens=N: transformers' prompt lookup decoding (n-gram matches in the context)
    hf-assisted   assistant_model=DRAFT: assisted generation with a smaller model of the same vocabulary
`with_prompt_lookup` / `with_assistant` make these from the plain baseline, sharing its model.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runtime.errors import CheckpointError, SpectreeError
from runtime.files import shown_path


class BaselineError(SpectreeError, RuntimeError):
    """The transformers baseline could not be built or did not generate what was asked."""


@dataclass(frozen=True)
class BaselineResult:
    token_ids: tuple[int, ...]  # generated ids only
    wall_s: float
    target_forwards: int  # calls of the model's forward (prefill included)


class HFBaseline:
    """A transformers causal LM in eval mode; `generate(ids, max_tokens)` is greedy and ignores EOS, passing
    `options` (extra `generate` keyword arguments, fixed per instance) on every call."""

    def __init__(self, model: Any, pad_token_id: int, name: str = "hf",
                 options: Mapping[str, Any] | None = None) -> None:
        self.model = model.eval()
        self.pad_token_id = pad_token_id
        self.name = name
        self.options = dict(options or {})
        self.attn_implementation = getattr(model.config, "_attn_implementation", None)

    def with_options(self, name: str, **options: Any) -> HFBaseline:
        """Another baseline on the same model (no copy of the weights) with more `generate` keyword arguments."""
        return HFBaseline(self.model, self.pad_token_id, name, {**self.options, **options})

    def with_prompt_lookup(self, num_tokens: int) -> HFBaseline:
        """transformers' prompt lookup decoding: up to `num_tokens` drafted from n-gram matches per step."""
        return self.with_options("hf-lookup", prompt_lookup_num_tokens=num_tokens)

    def with_assistant(self, assistant: Any) -> HFBaseline:
        """transformers' assisted generation with `assistant` (a causal LM of the same vocabulary, see
        `load_assistant`) drafting for this model."""
        return self.with_options("hf-assisted", assistant_model=assistant)

    def describe(self) -> dict[str, Any]:
        """JSON-ready: the transformers class, attention implementation, method, its options and the draft it
        verifies per step (transformers drafts a chain: at most `tree_nodes` - 1 tokens after the root)."""
        d: dict[str, Any] = {"attn_implementation": self.attn_implementation,
                             "transformers_class": type(self.model).__name__,
                             "method": "greedy", "tree": "none"}
        if "prompt_lookup_num_tokens" in self.options:
            n = self.options["prompt_lookup_num_tokens"]
            d.update(method="prompt_lookup", prompt_lookup_num_tokens=n, tree="chain", tree_nodes=n + 1)
        assistant = self.options.get("assistant_model")
        if assistant is not None:
            settings = _assistant_settings(assistant)
            d.update(method="assisted", tree="chain", tree_nodes=settings["num_assistant_tokens"] + 1, assistant={
                "path": shown_path(Path(assistant.name_or_path)) if assistant.name_or_path else None,
                "transformers_class": type(assistant).__name__,
                "parameters": sum(p.numel() for p in assistant.parameters()),
                **settings,
            })
        return d

    @classmethod
    def from_checkpoint(cls, path: str | Path, dtype: torch.dtype) -> HFBaseline:
        model = _load_causal_lm(path, dtype, "the hf baseline")
        return cls(model, _pad_id(model.config))

    @classmethod
    def from_engine(cls, engine: Any, dtype: torch.dtype) -> HFBaseline:
        """engine: a `runtime.engine.Engine`; its target weights are read back from trtllm_checkpoint/."""
        from transformers import AutoConfig, AutoModelForCausalLM

        from runtime.engine import is_target_tensor, target_from_trtllm

        config = AutoConfig.from_pretrained(str(engine.path("config.json").parent))
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        tensors = target_from_trtllm(engine.model_config(), engine.read_trtllm_tensors(include=is_target_tensor))
        missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=False)
        tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
        if set(missing) - tied or unexpected:
            raise BaselineError(f"{engine.root}: the engine's target tensors do not fit transformers' "
                                f"{type(model).__name__} (missing {sorted(set(missing) - tied)[:5]}, "
                                f"unexpected {sorted(unexpected)[:5]})")
        if tied:
            model.tie_weights()
        return cls(model, _pad_id(config))

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_tokens: int) -> BaselineResult:
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.model.device)
        calls = 0

        def count(module: Any, args: Any, kwargs: Any) -> None:
            nonlocal calls
            calls += 1

        hook = self.model.register_forward_pre_hook(count, with_kwargs=True)
        try:
            t0 = time.perf_counter()
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                      do_sample=False, eos_token_id=[], pad_token_id=self.pad_token_id,
                                      **self.options)
            wall = time.perf_counter() - t0
        finally:
            hook.remove()
        generated = tuple(out[0, ids.shape[1]:].tolist())
        if len(generated) != max_tokens:
            raise BaselineError(f"{self.name}: transformers generate returned {len(generated)} tokens, expected "
                                f"max_tokens = {max_tokens} (EOS should be disabled)")
        return BaselineResult(generated, wall, calls)


def load_assistant(path: str | Path, dtype: torch.dtype) -> Any:
    """The draft model of assisted generation: a transformers causal LM from a checkpoint directory, in eval mode.
    It must share the target's tokenizer (the caller checks the vocabulary size)."""
    return _load_causal_lm(path, dtype, "the assistant model").eval()


def _load_causal_lm(path: str | Path, dtype: torch.dtype, role: str) -> Any:
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"transformers cannot load {path} as {role}: {exc}") from exc


_ASSISTANT_SETTINGS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


def _assistant_settings(assistant: Any) -> dict[str, Any]:
    """The assisted-generation settings transformers will use: the assistant's generation config, where unset
    the defaults transformers fills in during generation (20 tokens, "constant" schedule, threshold 0.4 in 5.x)."""
    from transformers import GenerationConfig

    defaults = GenerationConfig._get_default_generation_params()
    gc = assistant.generation_config
    out = {}
    for key in _ASSISTANT_SETTINGS:
        value = getattr(gc, key, None)
        out[key] = defaults.get(key) if value is None else value
    return out


def _pad_id(config: Any) -> int:
    """Any valid id works as pad_token_id for batch 1 without padding; it only silences generate's warning."""
    for name in ("pad_token_id", "bos_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return 0


__all__ = ["BaselineError", "BaselineResult", "HFBaseline", "load_assistant"]
