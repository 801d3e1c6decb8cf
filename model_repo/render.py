"""Render a Triton model repository for an engine directory (or a Hugging Face checkpoint directory).

    REPO/
      ensemble/config.pbtxt        the entry point: text_input | messages, max_tokens, ... -> text_output. A
                                   decoupled python model (BLS) calling preprocessing, then spec_decode; the
                                   tensor names are tensorrtllm_backend's ensemble's
      ensemble/1/model.py          thin adapter: model_repo.triton_adapter.EnsembleModel
      preprocessing/config.pbtxt   tokenizer stage: text_input, or messages through the chat template ->
                                   input_ids, input_length
      preprocessing/1/model.py     thin adapter: model_repo.triton_adapter.PreprocessingModel
      spec_decode/config.pbtxt     decoupled generation model; parameters record the engine, the load options,
                                   the admission and request limits and the verification stage (greedy at
                                   temperature 0, rejection_sampling above)
      spec_decode/1/model.py       thin adapter: model_repo.triton_adapter.SpecDecodeModel
      spectree-repo.json           the RepoOptions this repository was rendered from (Triton ignores files at
                                   the repository root)

Every config.pbtxt is rendered from `model_repo.model_config` dataclasses by `model_repo.pbtxt` and parsed back
before it is written. spec_decode also takes text_input or messages directly (vllm_backend's single-model
style). The entry model is named `ensemble` (tensorrtllm_backend's name, which clients use) but is not a Triton
ensemble (platform "ensemble"): tritonserver 2.51's ensembles do not pass a client's cancellation on to a
running step, so a disconnected client's generation would run to its end; the BLS model passes it on.

The engine directory's checksums (engine.json) are verified before anything is rendered (skip_checksums: no).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Mapping
from typing import Any

from model_repo import contract, engines
from model_repo.pbtxt import dumps, loads
from model_repo.model_config import (
    InstanceGroup,
    Kind,
    ModelParameter,
    TransactionPolicy,
    TritonModelConfig,
)
from runtime import schema
from runtime.config import DTYPES
from runtime.draft_spec import drafter_kind, field_names
from runtime.errors import ConfigError
from runtime.scheduler_config import SchedulerConfig
from runtime.schema import setting
from runtime.files import remove_stale_work_dirs, work_dir

ENSEMBLE = "ensemble"
PREPROCESSING = "preprocessing"
SPEC_DECODE = "spec_decode"
MODELS = (ENSEMBLE, PREPROCESSING, SPEC_DECODE)
MANIFEST = "spectree-repo.json"
RENDERING = "rendering"  # the work_dir tag of a repository being rendered
LOAD_OPTION_KEYS = ("draft", "draft_model", "tree", "dtype", "max_draft_len")


@dataclass(frozen=True)
class RepoOptions:
    """Everything `python -m model_repo render` accepts (CLI flags and YAML keys are these field names)."""

    # engine directory (engine.json) or Hugging Face checkpoint directory, with tokenizer.json
    engine: str = setting(nonempty=True, what="a directory path")
    output: str = setting(nonempty=True, what="a directory path")  # repository directory to create
    engine_path_in_server: str | None = None  # the engine's path as the server sees it (a container mount);
    # None: the engine's absolute local path
    device: str = setting("cpu", choices=("cpu", "cuda"))  # instance kind of spec_decode (KIND_CPU / KIND_GPU)
    instances: int = setting(1, ge=1)  # spec_decode instances (each loads its own copy of the model)
    # requests decoded together per spec_decode instance (its batching scheduler's: one target
    # forward per step verifies all their draft trees); more wait in the queue
    max_concurrent_requests: int = setting(SchedulerConfig.max_concurrent_requests, ge=1)
    # rows per request the entry model takes: it batches like tensorrtllm_backend's ensemble (max_batch_size > 0,
    # [batch, 1] tensors); each row is one spec_decode request, the rows of a request run one after another
    max_batch_size: int = setting(8, ge=1)
    # requests waiting (FIFO) per instance; beyond it: UNAVAILABLE ("overloaded: ...")
    max_queue_size: int = setting(SchedulerConfig.max_queue_size, ge=0)
    # prompt tokens per request per step (a long prompt joins the batch over several steps instead of stalling it)
    prefill_chunk: int = setting(SchedulerConfig.prefill_chunk, ge=1)
    # tree nodes one step verifies across an instance's batch: each request's tree is pruned to an even share, so
    # speculation shrinks as the batch grows (runtime.batching, "Tree budget"); None: whole trees at any batch size
    tree_budget: int | None = setting(SchedulerConfig.tree_budget, ge=1)
    # largest max_tokens a request may ask; None: the engine's context length
    max_tokens_limit: int | None = setting(None, ge=1)
    # KV cache the running generations of an instance may reserve together (each: prompt + max_tokens + one draft
    # tree, capped at the context); a request that could never fit is refused, the rest wait for room.
    # None: half the memory free once the instance has loaded the model (GPU memory on cuda).
    kv_memory_mb: int | None = setting(None, ge=1)
    # text_input / messages size, checked before tokenising; None: 16 bytes per token of context (English averages
    # about 4)
    max_prompt_bytes: int | None = setting(None, ge=1)
    max_stop_words: int = setting(16, ge=1)  # stop strings per request
    max_stop_word_bytes: int = setting(256, ge=1)  # UTF-8 bytes per stop string
    # torch intra-op threads per instance; 0: torch's default (one per core). 1 by default: on the 2-core CPU
    # machine torch's default contends with tritonserver's own threads (perf serve, demo engine, concurrency 1:
    # 69 output tokens/s with the default vs 110-130 with 1 thread).
    torch_threads: int = setting(1, ge=0)
    # runtime.load overrides (None: the engine's own drafter / tree / dtype)
    draft: str | None = None  # a drafter kind (runtime.draft_spec.kind_names())
    draft_model: str | None = None
    tree: str | None = None
    dtype: str | None = setting(None, choices=tuple(DTYPES))
    max_draft_len: int | None = setting(None, ge=0)
    force: bool = setting(False)  # replace an existing output directory
    skip_checksums: bool = setting(False)  # do not verify the engine's files against engine.json's sha256 first

    def __post_init__(self) -> None:
        schema.check(self, ConfigError)
        if self.draft is not None:
            with field_names("load"):
                drafter_kind(self.draft)

    @classmethod
    def from_mapping(cls, data: Any, where: str = "options") -> RepoOptions:
        """Strict construction from a mapping (YAML, flags): unknown keys fail, required keys must be there, every
        value is type- and bound-checked (runtime.schema)."""
        return schema.load(cls, data, ConfigError, source=where)

    def load_options(self) -> dict[str, Any]:
        """Keyword arguments for runtime.load (only the ones set)."""
        return {k: getattr(self, k) for k in LOAD_OPTION_KEYS if getattr(self, k) is not None}


    def prompt_bytes_limit(self, max_context: int) -> int:
        """max_prompt_bytes, or its default for an engine with this context."""
        return self.max_prompt_bytes if self.max_prompt_bytes is not None else PROMPT_BYTES_PER_TOKEN * max_context


PROMPT_BYTES_PER_TOKEN = 16  # max_prompt_bytes's default, per token of context


@dataclass(frozen=True)
class RenderedRepo:
    path: Path
    configs: dict[str, TritonModelConfig]  # model name -> config written
    max_context: int
    max_tokens_limit: int


def _params(values: dict[str, Any]) -> dict[str, ModelParameter]:
    return {k: ModelParameter(v if isinstance(v, str) else json.dumps(v)) for k, v in values.items()}


def model_configs(
    options: RepoOptions, engine_path: str, max_context: int, max_tokens_limit: int
) -> dict[str, TritonModelConfig]:
    """The three model configs (pure: no filesystem access)."""
    cpu = InstanceGroup(kind=Kind.KIND_CPU, count=1)
    prompt_bytes = str(options.prompt_bytes_limit(max_context))
    preprocessing = TritonModelConfig(
        name=PREPROCESSING,
        backend="python",
        max_batch_size=0,
        input=contract.PREPROCESSING_INPUTS,
        output=contract.PREPROCESSING_OUTPUTS,
        instance_group=(cpu,),
        parameters=_params({"engine_dir": engine_path, "max_context": str(max_context),
                            "max_prompt_bytes": prompt_bytes}),
    )
    spec_decode = TritonModelConfig(
        name=SPEC_DECODE,
        backend="python",
        max_batch_size=0,
        input=contract.SPEC_DECODE_INPUTS,
        output=contract.SPEC_DECODE_OUTPUTS,
        instance_group=(InstanceGroup(kind=Kind.KIND_GPU if options.device == "cuda" else Kind.KIND_CPU,
                                      count=options.instances),),
        model_transaction_policy=TransactionPolicy(decoupled=True),
        parameters=_params({
            "engine_dir": engine_path,
            "load_options": options.load_options(),
            "max_concurrent_requests": str(options.max_concurrent_requests),
            "max_queue_size": str(options.max_queue_size),
            "prefill_chunk": str(options.prefill_chunk),
            "tree_budget": str(options.tree_budget or 0),  # 0: none
            "max_tokens_limit": str(max_tokens_limit),
            "kv_memory_mb": str(options.kv_memory_mb or 0),  # 0: decided at load (half the free memory)
            "max_prompt_bytes": prompt_bytes,
            "max_stop_words": str(options.max_stop_words),
            "max_stop_word_bytes": str(options.max_stop_word_bytes),
            "torch_threads": str(options.torch_threads),
            "device": options.device,
            # The lossless verification stage, explicit: runtime.verify's rule by temperature. spec_decode checks
            # these at load and reports the mode each request ran as its `verification` output.
            "verification_at_temperature_0": contract.VERIFICATION_GREEDY,
            "verification_above_temperature_0": contract.VERIFICATION_SAMPLED,
        }),
    )
    # The entry point holds every request spec_decode's instances can run or queue; more are refused at once.
    in_flight = options.instances * (options.max_concurrent_requests + options.max_queue_size)
    ensemble = TritonModelConfig(
        name=ENSEMBLE,
        backend="python",
        max_batch_size=options.max_batch_size,
        input=contract.ENSEMBLE_INPUTS,
        output=contract.ENSEMBLE_OUTPUTS,
        instance_group=(cpu,),
        model_transaction_policy=TransactionPolicy(decoupled=True),
        parameters=_params({"preprocessing_model": PREPROCESSING, "spec_decode_model": SPEC_DECODE,
                            "max_in_flight": str(in_flight)}),
    )
    return {ENSEMBLE: ensemble, PREPROCESSING: preprocessing, SPEC_DECODE: spec_decode}


ADAPTERS = {ENSEMBLE: "EnsembleModel", PREPROCESSING: "PreprocessingModel", SPEC_DECODE: "SpecDecodeModel"}


def adapter_module(model: str, cls: str, rendered_by: str) -> str:
    """model.py of a python model: one import of package code (model_repo.triton_adapter's `cls`)."""
    return (
        f'"""Triton python-backend entry point of {model} (rendered by `{rendered_by}`)."""\n\n'
        f"from model_repo.triton_adapter import {cls} as TritonPythonModel\n\n"
        f'__all__ = ["TritonPythonModel"]\n'
    )


def adapter_source(model: str) -> str:
    """model.py of a python model: one import of package code."""
    return adapter_module(model, ADAPTERS[model], "python -m model_repo render")


def write_repo(out: Path, configs: Mapping[str, TritonModelConfig], adapters: Mapping[str, str],
               manifest: dict[str, Any], force: bool) -> None:
    """Write a repository into out, atomically (into a work_dir sibling, then renamed into place): every
    config.pbtxt, parsed back before it is written; model.py of the python models (adapters: model name -> source);
    the manifest. An existing out is replaced only with force."""
    if out.exists() and not force:
        raise ConfigError(f"output: {str(out)!r} already exists (pass force to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_work_dirs(out, RENDERING)  # a killed render's leftovers
    tmp = work_dir(out, RENDERING)
    tmp.mkdir()
    try:
        for name, config in configs.items():
            text = dumps(config)
            if loads(TritonModelConfig, text) != config:  # the writer and the parser must agree
                raise ConfigError(f"{name}/config.pbtxt does not parse back to the config it was rendered from")
            (tmp / name / "1").mkdir(parents=True)
            (tmp / name / "config.pbtxt").write_text(text, encoding="utf-8")
            if name in adapters:
                (tmp / name / "1" / "model.py").write_text(adapters[name], encoding="utf-8")
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def render(options: RepoOptions) -> RenderedRepo:
    """Write the repository (atomically: into a temporary sibling, then renamed into place)."""
    engine = Path(options.engine)
    if not engine.is_dir():
        raise ConfigError(f"engine: {str(engine)!r} is not a directory")
    if not options.skip_checksums:
        engines.verify_engine(str(engine))
    max_context, _, has_tokenizer = engines.engine_facts(str(engine))
    if not has_tokenizer:
        raise ConfigError(f"engine: {str(engine)!r} has no tokenizer.json; the text pipeline needs one")
    limit = options.max_tokens_limit if options.max_tokens_limit is not None else max_context
    if limit > max_context:
        raise ConfigError(f"max_tokens_limit: {limit} is above the engine's context length {max_context}")
    if options.draft_model is not None and not Path(options.draft_model).is_dir():
        raise ConfigError(f"draft_model: {options.draft_model!r} is not a directory")
    engine_path = options.engine_path_in_server or str(engine.resolve())
    configs = model_configs(options, engine_path, max_context, limit)

    out = Path(options.output)
    manifest = {"format": "spectree-model-repo", "format_version": 1, "options": dataclasses.asdict(options),
                "engine_path_in_server": engine_path, "max_context": max_context, "max_tokens_limit": limit,
                "models": list(configs)}
    write_repo(out, configs, {name: adapter_source(name) for name in ADAPTERS}, manifest, options.force)
    return RenderedRepo(path=out, configs=configs, max_context=max_context, max_tokens_limit=limit)


def read_repo(path: str | Path) -> dict[str, TritonModelConfig]:
    """Parse every config.pbtxt of a repository (strict)."""
    root = Path(path)
    out = {}
    for cfg in sorted(root.glob("*/config.pbtxt")):
        out[cfg.parent.name] = loads(TritonModelConfig, cfg.read_text(encoding="utf-8"))
    if not out:
        raise ConfigError(f"{root}: no */config.pbtxt found; not a model repository")
    return out


__all__ = [
    "ENSEMBLE",
    "MANIFEST",
    "MODELS",
    "PREPROCESSING",
    "SPEC_DECODE",
    "RenderedRepo",
    "RepoOptions",
    "adapter_module",
    "adapter_source",
    "model_configs",
    "read_repo",
    "render",
    "write_repo",
]
