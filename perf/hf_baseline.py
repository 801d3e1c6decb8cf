"""The `transformers` baseline: greedy `generate` of the reference implementation on the same weights.

transformers is imported lazily (the runtime never imports it; perf uses it only for this baseline). The model
is the target the benchmark's runtime decoders use:
    an HF checkpoint directory   AutoModelForCausalLM.from_pretrained(dir) in the same dtype;
    an engine directory          the model built from the engine's config.json with the weights re-assembled
                                 from its TensorRT-LLM checkpoint (`runtime.engine.target_from_trtllm`), i.e.
                                 exactly the weights the runtime serves.
Generation is greedy with EOS disabled (`eos_token_id=[]`), so it runs for exactly `max_new_tokens`, as the
runtime does with `ignore_eos`. Every target forward is counted with a forward pre-hook.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runtime.errors import CheckpointError, SpectreeError


class BaselineError(SpectreeError, RuntimeError):
    """The transformers baseline could not be built or did not generate what was asked."""


@dataclass(frozen=True)
class BaselineResult:
    token_ids: tuple[int, ...]  # generated ids only
    wall_s: float
    target_forwards: int  # calls of the model's forward (prefill included)


class HFBaseline:
    """A transformers causal LM in eval mode; `generate(ids, max_tokens)` is greedy and ignores EOS."""

    name = "hf"

    def __init__(self, model: Any, pad_token_id: int) -> None:
        self.model = model.eval()
        self.pad_token_id = pad_token_id
        self.attn_implementation = getattr(model.config, "_attn_implementation", None)

    @classmethod
    def from_checkpoint(cls, path: str | Path, dtype: torch.dtype) -> HFBaseline:
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"transformers cannot load {path} for the hf baseline: {exc}") from exc
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
                                      do_sample=False, eos_token_id=[], pad_token_id=self.pad_token_id)
            wall = time.perf_counter() - t0
        finally:
            hook.remove()
        generated = tuple(out[0, ids.shape[1]:].tolist())
        if len(generated) != max_tokens:
            raise BaselineError(f"transformers generate returned {len(generated)} tokens, expected max_tokens = "
                                f"{max_tokens} (EOS should be disabled)")
        return BaselineResult(generated, wall, calls)


def _pad_id(config: Any) -> int:
    """Any valid id works as pad_token_id for batch 1 without padding; it only silences generate's warning."""
    for name in ("pad_token_id", "bos_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return 0


__all__ = ["BaselineError", "BaselineResult", "HFBaseline"]
