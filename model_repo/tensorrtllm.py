"""`python -m model_repo render --backend tensorrtllm`: a Triton repository that serves the TensorRT-LLM engine
built from an engine directory with NVIDIA's tensorrtllm backend, in the layout of tensorrtllm_backend's
`inflight_batcher_llm` (since mid-2025 in NVIDIA/TensorRT-LLM under triton_backend/all_models/), plus our
lossless verification stage.

    REPO/
      preprocessing/      python, our adapter over runtime.tokenizer: QUERY, REQUEST_OUTPUT_LEN, ... -> INPUT_ID,
                          REQUEST_INPUT_LEN, stop / bad word lists in TensorRT-LLM's [2, -1] layout
      tensorrt_llm/       backend "tensorrtllm" (C++): the TensorRT-LLM engine (gpt_model_path), decoding_mode and
                          medusa_choices / eagle_choices from engine.json, batch size and KV-cache settings
      postprocessing/     python, our adapter: TOKENS_BATCH, SEQUENCE_LENGTH -> OUTPUT (text)
      ensemble/           text_input, max_tokens, ... -> preprocessing -> tensorrt_llm -> postprocessing -> text_output
      tensorrt_llm_bls/   python BLS (decoupled): the same request interface, orchestrated in package code here
      spectree_verify/    python: our lossless verification stage (below)
      spectree-repo.json  the options it was rendered from

Every config.pbtxt comes from `model_repo.model_config` dataclasses written by `model_repo.pbtxt`; its parameter keys
are the public templates' keys (tests/fixtures/tensorrtllm_templates.json records them with their source
commits). A parameter we do not set carries the templates' unfilled placeholder `${key}`, which the backend reads
as unset (its model_instance_state.cc compares against that placeholder or fails to parse it and keeps the
default) - the same state as a template whose variable fill_template.py was not given.

Lossless sampling. TensorRT-LLM runs Medusa greedily only and accepts EAGLE drafts by typical acceptance (lossy)
when sampling; greedy tree acceptance is exact, so greedy requests are served by the engine as is. For a tree
engine (Medusa, EAGLE) the ensemble therefore takes no sampling inputs (temperature, top_k, top_p, seed), and the
BLS refuses a sampled request with INVALID_ARG instead of serving a distribution that is not the target's.
`spectree_verify` is the stage that makes sampled tree decoding lossless: given the target's logits at every
node of a drafted tree (what one tree forward of the engine computes) it runs `runtime.verify` - the same call,
proposal rule and generator use as `runtime.decode.SpecDecoder` - and returns the accepted path, the emitted
tokens and whether the last one is a bonus token. Its computation is tested here against the runtime's; feeding
it the engine's tree logits needs an engine run that returns per-node logits, which has NOT been exercised: no
GPU and no TensorRT-LLM were available where this was written. The same holds for the whole tensorrt_llm path of
this repository: its configs parse with Triton's ModelConfig protobuf and match the public templates' keys, and
the python stages' package code is tested on CPU, but no tritonserver with the tensorrtllm backend has loaded it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model_repo.contract import field_inputs
from model_repo.pbtxt import loads
from model_repo.render import adapter_module, write_repo
from model_repo.request import tensor_values
from model_repo.model_config import (
    DataType,
    DynamicBatching,
    EnsembleScheduling,
    EnsembleStep,
    InstanceGroup,
    Kind,
    ModelInput,
    ModelOutput,
    ModelParameter,
    QueuePolicy,
    Reshape,
    TransactionPolicy,
    TritonModelConfig,
)
from builder.drafters import builder_kind, builder_kinds
from runtime import schema
from runtime.draft_spec import DraftSpec
from runtime.errors import ConfigError, RequestError
from runtime.request_fields import FIELDS, REQUEST_FIELDS, sampling_params
from runtime.schema import setting

PREPROCESSING = "preprocessing"
TENSORRT_LLM = "tensorrt_llm"
POSTPROCESSING = "postprocessing"
ENSEMBLE = "ensemble"
BLS = "tensorrt_llm_bls"
VERIFY = "spectree_verify"
MODELS = (PREPROCESSING, TENSORRT_LLM, POSTPROCESSING, ENSEMBLE, BLS, VERIFY)
TEMPLATE_MODELS = (PREPROCESSING, TENSORRT_LLM, POSTPROCESSING, ENSEMBLE, BLS)  # the public layout's five
BACKEND = "tensorrtllm"
BACKENDS = ("python", BACKEND)  # `python -m model_repo render --backend`; the first is the default
# The templates' literal for the executor worker inside NVIDIA's Triton TensorRT-LLM container.
EXECUTOR_WORKER = "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker"


def tree_decoding_modes() -> frozenset[str]:
    """The backend's decoding modes that decode a drafter's tree (the drafter kinds' `backend_decoding_mode`)."""
    return frozenset(k.backend_decoding_mode for k in builder_kinds() if k.trtllm_tree)


def unset(key: str) -> str:
    """A parameter left as the public template leaves an unfilled variable."""
    return "${" + key + "}"


@dataclass(frozen=True)
class TrtllmRepoOptions:
    """What `python -m model_repo render --backend tensorrtllm` accepts (flags and YAML keys are these names)."""

    # our engine directory (engine.json, tokenizer.json, trtllm_checkpoint/)
    engine: str = setting(nonempty=True, what="a directory path")
    output: str = setting(nonempty=True, what="a directory path")  # repository directory to create
    trtllm_engine: str | None = None  # trtllm-build's output; None: ENGINE/trtllm_engine (trtllm-build.sh's default)
    engine_path_in_server: str | None = None  # ENGINE as the server sees it (a container mount); None: local path
    trtllm_engine_path_in_server: str | None = None  # the TensorRT-LLM engine as the server sees it
    # triton_max_batch_size; None: the engine's build.max_batch_size
    max_batch_size: int | None = setting(None, ge=1)
    max_queue_delay_microseconds: int = setting(0, ge=0)
    kv_cache_free_gpu_mem_fraction: float = setting(0.9, gt=0.0, le=1.0)
    # instances of each python model (preprocessing, postprocessing, BLS, verify)
    instances: int = setting(1, ge=1)
    force: bool = setting(False)

    def __post_init__(self) -> None:
        schema.check(self, ConfigError)


# ---- what the engine directory says -------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineFacts:
    """The parts of engine.json the repository is filled from."""

    kind: str  # the drafter kind
    choices: tuple[tuple[int, ...], ...] | None  # static tree, canonical order
    draft: DraftSpec  # the drafter the engine was built for
    max_batch_size: int
    max_seq_len: int
    trtllm_dtype: str

    @classmethod
    def read(cls, engine_dir: str | Path) -> EngineFacts:
        from runtime.engine import open_engine

        engine = open_engine(engine_dir)
        trt = engine.manifest.get("trtllm") or {}
        tree = engine.draft.static_tree
        return cls(kind=engine.draft.kind, choices=None if tree is None else tree.choices, draft=engine.draft,
                   max_batch_size=engine.limits.max_batch_size,
                   max_seq_len=engine.limits.max_seq_len, trtllm_dtype=str(trt.get("dtype", engine.dtype)))


def choices_parameter(choices: Sequence[Sequence[int]]) -> str:
    """medusa_choices / eagle_choices as the backend parses them (utils.cc csvStrToVecVecInt): "{0}, {0, 1}"."""
    return ", ".join("{" + ", ".join(str(r) for r in path) + "}" for path in choices)


def parse_choices_parameter(text: str) -> tuple[tuple[int, ...], ...]:
    """Inverse of choices_parameter (for checks)."""
    body = text.strip()
    if not (body.startswith("{") and body.endswith("}")):
        raise ConfigError(f"choices {text!r}: expected {{...}}, {{...}}")
    return tuple(tuple(int(x) for x in part.split(",") if x.strip()) for part in body[1:-1].split("}, {"))


# ---- the tensors ------------------------------------------------------------------------------------------

S, I32 = DataType.TYPE_STRING, DataType.TYPE_INT32
F32, B = DataType.TYPE_FP32, DataType.TYPE_BOOL
SCALAR = Reshape(())


def _in(name: str, dtype: DataType, dims: tuple[int, ...], optional: bool = False, scalar: bool = False,
        ragged: bool = False) -> ModelInput:
    return ModelInput(name, dtype, dims, optional=optional, reshape=SCALAR if scalar else None,
                      allow_ragged_batch=True if ragged else None)


# Names, types and shapes are the public templates' (tests check them against the fixture).
PREPROCESSING_INPUTS = (
    _in("QUERY", S, (1,)),
    _in("REQUEST_OUTPUT_LEN", I32, (1,)),
    _in("BAD_WORDS_DICT", S, (-1,), optional=True),
    _in("STOP_WORDS_DICT", S, (-1,), optional=True),
    _in("END_ID", I32, (1,), optional=True),
    _in("PAD_ID", I32, (1,), optional=True),
)
PREPROCESSING_OUTPUTS = (
    ModelOutput("INPUT_ID", I32, (-1,)),
    ModelOutput("REQUEST_INPUT_LEN", I32, (1,)),
    ModelOutput("BAD_WORDS_IDS", I32, (2, -1)),
    ModelOutput("STOP_WORDS_IDS", I32, (2, -1)),
    ModelOutput("REQUEST_OUTPUT_LEN", I32, (-1,)),
    ModelOutput("OUT_END_ID", I32, (1,)),
    ModelOutput("OUT_PAD_ID", I32, (1,)),
)
# The request contract's fields the tensorrt_llm model samples by (runtime.request_fields: Wire.trtllm names its input)
TRTLLM_FIELDS = tuple(f for f in REQUEST_FIELDS if f.wire.trtllm)
SAMPLING_TRTLLM_INPUTS = tuple(_in(f.wire.trtllm, DataType(f.wire.tensor_type), (1,), optional=True, scalar=True)
                               for f in TRTLLM_FIELDS)
TENSORRT_LLM_INPUTS = (
    _in("input_ids", I32, (-1,), optional=True, ragged=True),
    _in("input_lengths", I32, (1,), scalar=True),
    _in("request_output_len", I32, (1,), scalar=True),
    _in("end_id", I32, (1,), optional=True, scalar=True),
    _in("pad_id", I32, (1,), optional=True, scalar=True),
    _in("stop_words_list", I32, (2, -1), optional=True, ragged=True),
    _in("bad_words_list", I32, (2, -1), optional=True, ragged=True),
    *SAMPLING_TRTLLM_INPUTS,
    _in("exclude_input_in_output", B, (1,), optional=True, scalar=True),
    _in("streaming", B, (1,), optional=True, scalar=True),
)
TENSORRT_LLM_OUTPUTS = (
    ModelOutput("output_ids", I32, (-1, -1)),
    ModelOutput("sequence_length", I32, (-1,)),
    ModelOutput("acceptance_rate", F32, (1,)),
    ModelOutput("total_accepted_draft_tokens", I32, (1,)),
    ModelOutput("total_draft_tokens", I32, (1,)),
)
POSTPROCESSING_INPUTS = (_in("TOKENS_BATCH", I32, (-1, -1)), _in("SEQUENCE_LENGTH", I32, (-1,)))
POSTPROCESSING_OUTPUTS = (ModelOutput("OUTPUT", S, (-1,)),)
# ... as the ensemble and BLS take them from clients (tensorrtllm_backend's current names)
SAMPLING_CLIENT_INPUTS = tuple(field_inputs(f)[0] for f in TRTLLM_FIELDS)
CLIENT_INPUTS = (
    _in("text_input", S, (1,)),
    _in("max_tokens", I32, (1,)),
    _in("bad_words", S, (-1,), optional=True),
    _in("stop_words", S, (-1,), optional=True),
    _in("end_id", I32, (1,), optional=True),
    _in("pad_id", I32, (1,), optional=True),
    _in("stream", B, (1,), optional=True),
)
TEXT_OUTPUT = ModelOutput("text_output", S, (-1,))
SPEC_OUTPUTS = (
    ModelOutput("acceptance_rate", F32, (1,)),
    ModelOutput("total_accepted_draft_tokens", I32, (1,)),
    ModelOutput("total_draft_tokens", I32, (1,)),
)
# client input -> the preprocessing / tensorrt_llm input it feeds (the templates' ensemble wiring)
TO_PREPROCESSING = {"text_input": "QUERY", "max_tokens": "REQUEST_OUTPUT_LEN", "bad_words": "BAD_WORDS_DICT",
                    "stop_words": "STOP_WORDS_DICT", "end_id": "END_ID", "pad_id": "PAD_ID"}
TO_TENSORRT_LLM = {"stream": "streaming", **{i.name: f.wire.trtllm for i, f in zip(SAMPLING_CLIENT_INPUTS,
                                                                                    TRTLLM_FIELDS)}}
PREPROCESSED = {"INPUT_ID": "input_ids", "REQUEST_INPUT_LEN": "input_lengths",
                "REQUEST_OUTPUT_LEN": "request_output_len", "OUT_END_ID": "end_id", "OUT_PAD_ID": "pad_id",
                "STOP_WORDS_IDS": "stop_words_list",
                "BAD_WORDS_IDS": "bad_words_list"}

VERIFY_INPUTS = (
    ModelInput("tree_logits", F32, (-1, -1)),  # [num_nodes, vocab]: the target's logits at every tree node
    ModelInput("draft_tokens", I32, (-1,)),  # [num_nodes]: node 0 is the root (the last committed token)
    ModelInput("tree_parents", I32, (-1,), optional=True),  # [num_nodes]: parent of each node (-1 for the root);
    # absent: the engine's static tree
    *(i for f in TRTLLM_FIELDS for i in field_inputs(f)),  # the sampling settings, as spec_decode takes them
)
VERIFY_OUTPUTS = (
    ModelOutput("accepted_path", I32, (-1,)),  # node indices, root first
    ModelOutput("output_ids", I32, (-1,)),  # the accepted draft tokens, then the bonus / residual token
    ModelOutput("bonus", B, (1,)),
    ModelOutput("verification", S, (1,)),
)


# ---- the configs ------------------------------------------------------------------------------------------


def _params(values: Mapping[str, str]) -> dict[str, ModelParameter]:
    return {k: ModelParameter(v) for k, v in values.items()}


def _unset_all(keys: Iterable[str], values: Mapping[str, str]) -> dict[str, str]:
    return {k: values.get(k, unset(k)) for k in keys}


PREPROCESSING_KEYS = ("tokenizer_dir", "add_special_tokens", "multimodal_model_path", "gpt_model_path",
                      "max_num_images", "hf_model_path")
POSTPROCESSING_KEYS = ("tokenizer_dir", "skip_special_tokens")
BLS_KEYS = ("accumulate_tokens", "tensorrt_llm_model_name", "tensorrt_llm_draft_model_name", "multimodal_encoders_name")
TENSORRT_LLM_KEYS = (
    "max_beam_width", "FORCE_CPU_ONLY_INPUT_TENSORS", "gpt_model_type", "gpt_model_path", "encoder_model_path",
    "max_tokens_in_paged_kv_cache", "max_attention_window_size", "sink_token_length", "batch_scheduler_policy",
    "kv_cache_free_gpu_mem_fraction", "cross_kv_cache_fraction", "kv_cache_host_memory_bytes",
    "kv_cache_onboard_blocks", "exclude_input_in_output", "cancellation_check_period_ms", "stats_check_period_ms",
    "iter_stats_max_iterations", "request_stats_max_iterations", "enable_kv_cache_reuse", "normalize_log_probs",
    "enable_chunked_context", "gpu_device_ids", "participant_ids", "num_nodes", "lora_cache_optimal_adapter_size",
    "lora_cache_max_adapter_size", "lora_cache_gpu_memory_fraction", "lora_cache_host_memory_bytes",
    "lora_prefetch_dir", "decoding_mode", "executor_worker_path", "lookahead_window_size", "lookahead_ngram_size",
    "lookahead_verification_set_size", "medusa_choices", "eagle_choices", "gpu_weights_percent",
    "enable_context_fmha_fp32_acc", "multi_block_mode", "cuda_graph_mode", "cuda_graph_cache_size",
    "speculative_decoding_fast_logits", "tokenizer_dir", "guided_decoding_backend", "xgrammar_tokenizer_info_path",
)


def check_engine(facts: EngineFacts) -> None:
    """ConfigError when the tensorrtllm backend cannot serve this engine as built."""
    kind = builder_kind(facts.kind)
    kind.check_trtllm_backend(facts.draft)
    if kind.trtllm_tree and facts.choices is None:
        raise ConfigError(f"engine: a {facts.kind} engine without a static tree in engine.json")


def model_configs(options: TrtllmRepoOptions, facts: EngineFacts, engine_path: str,
                  trtllm_engine_path: str) -> dict[str, TritonModelConfig]:
    """The six model configs (pure: no filesystem access)."""
    check_engine(facts)
    batch = options.max_batch_size if options.max_batch_size is not None else facts.max_batch_size
    if batch > facts.max_batch_size:
        raise ConfigError(f"max_batch_size: {batch} is above the engine's build.max_batch_size {facts.max_batch_size}")
    kind = builder_kind(facts.kind)
    tree = kind.trtllm_tree
    batching = DynamicBatching(preferred_batch_size=(batch,),
                               max_queue_delay_microseconds=options.max_queue_delay_microseconds,
                               default_queue_policy=QueuePolicy(max_queue_size=0))
    cpu = (InstanceGroup(kind=Kind.KIND_CPU, count=options.instances),)
    choices = choices_parameter(facts.choices) if tree else None
    preprocessing = TritonModelConfig(
        name=PREPROCESSING, backend="python", max_batch_size=batch, input=PREPROCESSING_INPUTS,
        output=PREPROCESSING_OUTPUTS, instance_group=cpu, dynamic_batching=batching,
        parameters=_params(_unset_all(PREPROCESSING_KEYS, {
            "tokenizer_dir": engine_path, "add_special_tokens": "true", "gpt_model_path": trtllm_engine_path})),
    )
    trt = TritonModelConfig(
        name=TENSORRT_LLM, backend=BACKEND, max_batch_size=batch,
        input=TENSORRT_LLM_INPUTS if not tree else tuple(i for i in TENSORRT_LLM_INPUTS
                                                         if i not in SAMPLING_TRTLLM_INPUTS),
        output=TENSORRT_LLM_OUTPUTS,
        # The tensorrtllm backend places the engine on the GPUs itself; the templates declare KIND_CPU.
        instance_group=(InstanceGroup(kind=Kind.KIND_CPU, count=1),),
        model_transaction_policy=TransactionPolicy(decoupled=True), dynamic_batching=batching,
        parameters=_params(_unset_all(TENSORRT_LLM_KEYS, {
            "max_beam_width": "1",
            "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
            "gpt_model_type": "inflight_fused_batching",
            "gpt_model_path": trtllm_engine_path,
            "batch_scheduler_policy": "guaranteed_no_evict",
            "kv_cache_free_gpu_mem_fraction": repr(float(options.kv_cache_free_gpu_mem_fraction)),
            "exclude_input_in_output": "true",
            "enable_kv_cache_reuse": "false",
            "normalize_log_probs": "true",
            "enable_chunked_context": "false",
            "decoding_mode": kind.backend_decoding_mode,
            "executor_worker_path": EXECUTOR_WORKER,
            **({f"{facts.kind}_choices": choices} if tree else {}),
        })),
    )
    postprocessing = TritonModelConfig(
        name=POSTPROCESSING, backend="python", max_batch_size=batch, input=POSTPROCESSING_INPUTS,
        output=POSTPROCESSING_OUTPUTS, instance_group=cpu, dynamic_batching=DynamicBatching(),
        parameters=_params(_unset_all(POSTPROCESSING_KEYS, {"tokenizer_dir": engine_path,
                                                            "skip_special_tokens": "true"})),
    )
    client_inputs = CLIENT_INPUTS + (() if tree else SAMPLING_CLIENT_INPUTS)
    ensemble = TritonModelConfig(
        name=ENSEMBLE, platform="ensemble", max_batch_size=batch, input=client_inputs,
        output=(TEXT_OUTPUT, *SPEC_OUTPUTS),
        ensemble_scheduling=EnsembleScheduling(step=(
            EnsembleStep(model_name=PREPROCESSING, model_version=-1,
                         input_map={v: k for k, v in TO_PREPROCESSING.items()},
                         output_map={k: f"_{v}" for k, v in PREPROCESSED.items()}),
            EnsembleStep(model_name=TENSORRT_LLM, model_version=-1,
                         input_map={**{v: f"_{v}" for v in PREPROCESSED.values()},
                                    **{v: k for k, v in TO_TENSORRT_LLM.items()
                                       if any(i.name == k for i in client_inputs)}},
                         output_map={"output_ids": "_output_ids", "sequence_length": "_sequence_length",
                                     **{o.name: o.name for o in SPEC_OUTPUTS}}),
            EnsembleStep(model_name=POSTPROCESSING, model_version=-1,
                         input_map={"TOKENS_BATCH": "_output_ids", "SEQUENCE_LENGTH": "_sequence_length"},
                         output_map={"OUTPUT": "text_output"}),
        )),
    )
    bls = TritonModelConfig(
        name=BLS, backend="python", max_batch_size=batch, input=CLIENT_INPUTS + SAMPLING_CLIENT_INPUTS,
        output=(TEXT_OUTPUT, *SPEC_OUTPUTS), instance_group=cpu,
        model_transaction_policy=TransactionPolicy(decoupled=True),
        # The BLS reads the engine's decoding_mode from tensorrt_llm/config.pbtxt (one home for it).
        parameters=_params(_unset_all(BLS_KEYS, {"accumulate_tokens": "false",
                                                 "tensorrt_llm_model_name": TENSORRT_LLM})),
    )
    verify = TritonModelConfig(
        name=VERIFY, backend="python", max_batch_size=0, input=VERIFY_INPUTS, output=VERIFY_OUTPUTS,
        instance_group=cpu,
        parameters=_params({"engine_dir": engine_path, "draft_method": facts.kind,
                            "tree_choices": json.dumps([list(c) for c in facts.choices or ()])}),
    )
    return {PREPROCESSING: preprocessing, TENSORRT_LLM: trt, POSTPROCESSING: postprocessing, ENSEMBLE: ensemble,
            BLS: bls, VERIFY: verify}


ADAPTERS = {PREPROCESSING: "TrtllmPreprocessingModel", POSTPROCESSING: "TrtllmPostprocessingModel",
            BLS: "TrtllmBlsModel", VERIFY: "SpectreeVerifyModel"}


def adapter_source(model: str) -> str:
    """model.py of a python model: one import of package code."""
    return adapter_module(model, ADAPTERS[model], "python -m model_repo render --backend tensorrtllm")


@dataclass(frozen=True)
class RenderedTrtllmRepo:
    path: Path
    configs: dict[str, TritonModelConfig]
    trtllm_engine: str


def render_tensorrtllm(options: TrtllmRepoOptions) -> RenderedTrtllmRepo:
    """Write the repository (atomically: into a temporary sibling, then renamed into place)."""
    from runtime.engine import is_engine_dir

    engine = Path(options.engine)
    if not is_engine_dir(engine):
        raise ConfigError(f"engine: {str(engine)!r} is not an engine directory (no engine.json); the tensorrtllm "
                          "backend serves engines built by `python -m builder build`")
    if not (engine / "tokenizer.json").is_file():
        raise ConfigError(f"engine: {str(engine)!r} has no tokenizer.json; the text pipeline needs one")
    facts = EngineFacts.read(engine)
    from builder.trtllm import TRTLLM_ENGINE_DIR

    trtllm_engine = options.trtllm_engine or str(engine / TRTLLM_ENGINE_DIR)
    engine_path = options.engine_path_in_server or str(engine.resolve())
    trtllm_path = options.trtllm_engine_path_in_server or (
        str(Path(trtllm_engine).resolve()) if options.trtllm_engine or not options.engine_path_in_server
        else f"{options.engine_path_in_server.rstrip('/')}/{TRTLLM_ENGINE_DIR}")
    configs = model_configs(options, facts, engine_path, trtllm_path)
    out = Path(options.output)
    manifest = {"format": "spectree-model-repo", "format_version": 1, "backend": BACKEND,
                "options": dataclasses.asdict(options), "engine_path_in_server": engine_path,
                "trtllm_engine_path_in_server": trtllm_path, "models": list(configs),
                "tested": "configs parse with Triton's ModelConfig protobuf; not loaded by a tensorrtllm-backend "
                          "server (no GPU / TensorRT-LLM where this was rendered and tested)"}
    write_repo(out, configs, {name: adapter_source(name) for name in ADAPTERS}, manifest, options.force)
    return RenderedTrtllmRepo(path=out, configs=configs, trtllm_engine=trtllm_path)


# ---- the python stages' package code (model_repo/triton_adapter.py calls these) ----------------------------------


def _texts(array: np.ndarray | None) -> list[list[str]]:
    """A [batch, n] BYTES array -> per batch item, its strings (empty strings dropped)."""
    if array is None:
        return []
    rows = array.reshape(array.shape[0], -1) if array.ndim else array.reshape(1, 1)
    out = []
    for row in rows:
        out.append([v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in row if v not in (b"", "")])
    return out


def word_list(words: Sequence[Sequence[int]]) -> np.ndarray:
    """TensorRT-LLM's stop / bad words layout for one request: [2, n] int32, row 0 the words' token ids
    concatenated, row 1 each word's end offset, padded with -1; no words: [[0], [-1]]."""
    ids = [t for w in words for t in w]
    ends = np.cumsum([len(w) for w in words]).tolist() if words else []
    n = max(len(ids), 1)
    out = np.zeros((2, n), dtype=np.int32)
    out[1, :] = -1
    out[0, : len(ids)] = ids
    out[1, : len(ends)] = ends
    return out


def _stack_ragged(rows: Sequence[np.ndarray], pad: int) -> np.ndarray:
    """Stack [..., n_i] arrays along a new batch axis, padding the last axis with `pad`."""
    width = max(r.shape[-1] for r in rows)
    out = np.full((len(rows), *rows[0].shape[:-1], width), pad, dtype=rows[0].dtype)
    for i, r in enumerate(rows):
        out[i, ..., : r.shape[-1]] = r
    return out


def preprocess_batch(inputs: Mapping[str, np.ndarray], tokenizer: Any, add_special_tokens: bool,
                     max_context: int) -> dict[str, np.ndarray]:
    """The preprocessing model's work for one (batched) request, as the templates' preprocessing lays it out.

    inputs: QUERY [B, 1] BYTES, REQUEST_OUTPUT_LEN [B, 1] INT32, optional END_ID / PAD_ID [B, 1],
    STOP_WORDS_DICT / BAD_WORDS_DICT [B, n] BYTES. A prompt longer than the engine's context, or no room left
    for one output token, is a RequestError naming the input.
    """
    if "QUERY" not in inputs or "REQUEST_OUTPUT_LEN" not in inputs:
        raise RequestError("QUERY and REQUEST_OUTPUT_LEN are required")
    queries = _texts(inputs["QUERY"])
    out_len = inputs["REQUEST_OUTPUT_LEN"].reshape(len(queries), -1)[:, :1].astype(np.int32)
    ids = [np.asarray(tokenizer.encode(q[0] if q else "", add_bos=add_special_tokens), dtype=np.int32)
           for q in queries]
    for i, row in enumerate(ids):
        if row.size == 0:
            raise RequestError(f"QUERY[{i}] is empty")
        if row.size + 1 > max_context:
            raise RequestError(f"QUERY[{i}]: {row.size} prompt tokens leave no room in the engine's context of "
                               f"{max_context} tokens")
    eos = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else 0
    end_id = inputs.get("END_ID")
    pad_id = inputs.get("PAD_ID")
    end = (end_id.reshape(len(ids), -1)[:, :1] if end_id is not None else np.full((len(ids), 1), eos)).astype(np.int32)
    pad = (pad_id.reshape(len(ids), -1)[:, :1] if pad_id is not None else end.copy()).astype(np.int32)

    def words(name: str) -> np.ndarray:
        lists = _texts(inputs.get(name)) or [[] for _ in ids]
        return _stack_ragged([word_list([tokenizer.encode(w, add_bos=False) for w in ws]) for ws in lists], -1)

    return {
        "INPUT_ID": _stack_ragged(ids, int(pad[0, 0])),
        "REQUEST_INPUT_LEN": np.array([[r.size] for r in ids], dtype=np.int32),
        "BAD_WORDS_IDS": words("BAD_WORDS_DICT"),
        "STOP_WORDS_IDS": words("STOP_WORDS_DICT"),
        "REQUEST_OUTPUT_LEN": out_len,
        "OUT_END_ID": end,
        "OUT_PAD_ID": pad,
    }


def postprocess_batch(inputs: Mapping[str, np.ndarray], tokenizer: Any,
                      skip_special_tokens: bool) -> dict[str, np.ndarray]:
    """TOKENS_BATCH [B, beams, T] INT32 and SEQUENCE_LENGTH [B, beams] -> OUTPUT [B, beams] BYTES (the text of each
    beam's first SEQUENCE_LENGTH tokens; exclude_input_in_output makes those the generated tokens only)."""
    tokens = inputs["TOKENS_BATCH"]
    lengths = inputs["SEQUENCE_LENGTH"]
    tokens = tokens.reshape(tokens.shape[0], -1, tokens.shape[-1])
    lengths = lengths.reshape(tokens.shape[0], -1)
    texts = [[tokenizer.decode(tokens[b, k, : int(lengths[b, k])].tolist(), skip_special_tokens=skip_special_tokens)
              .encode("utf-8") for k in range(tokens.shape[1])] for b in range(tokens.shape[0])]
    return {"OUTPUT": np.array(texts, dtype=object)}


# ---- the BLS ----------------------------------------------------------------------------------------------


def decoding_mode_of(repository: str | Path, model: str = TENSORRT_LLM) -> str:
    """The decoding_mode parameter of the repository's tensorrt_llm model (what the BLS routes by)."""
    path = Path(repository) / model / "config.pbtxt"
    try:
        config = loads(TritonModelConfig, path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    return config.parameter("decoding_mode")


Infer = Callable[[str, Mapping[str, np.ndarray], bool], Iterator[dict[str, np.ndarray]]]


def _scalar(inputs: Mapping[str, np.ndarray], name: str, default: Any) -> Any:
    v = inputs.get(name)
    return default if v is None else v.reshape(-1)[0].item()


def check_sampling(inputs: Mapping[str, np.ndarray], decoding_mode: str) -> None:
    """RequestError for a sampled request on a tree engine: TensorRT-LLM runs Medusa greedily only and accepts EAGLE
    drafts by typical acceptance when sampling, so neither samples from the target's distribution."""
    values, _ = tensor_values(inputs, (FIELDS["temperature"], FIELDS["top_k"]))
    temperature = float(values.get("temperature", FIELDS["temperature"].default))
    top_k = int(values.get("top_k", FIELDS["top_k"].default))
    if decoding_mode in tree_decoding_modes() and temperature > 0 and top_k != 1:
        raise RequestError(
            f"temperature {temperature:g}: this {decoding_mode} engine decodes losslessly only greedily under "
            "TensorRT-LLM (Medusa is greedy-only there, EAGLE sampling uses lossy typical acceptance); send "
            f"temperature 0, verify tree logits with the {VERIFY} model, or serve the engine with the python "
            "backend repository (`python -m model_repo render --backend python`)")


def bls_generate(inputs: Mapping[str, np.ndarray], decoding_mode: str, infer: Infer) -> Iterator[dict[str, np.ndarray]]:
    """The BLS request: preprocessing -> tensorrt_llm (streamed when `stream`) -> postprocessing per response.

    inputs: the client's tensors, each [1, ...] (batch dimension first; one prompt per request).
    infer(model, inputs, decoupled) yields the model's responses.
    """
    if "text_input" not in inputs or "max_tokens" not in inputs:
        raise RequestError("text_input and max_tokens are required")
    if inputs["text_input"].shape[0] != 1:
        raise RequestError(f"text_input: one prompt per request, got a batch of {inputs['text_input'].shape[0]}")
    check_sampling(inputs, decoding_mode)
    batched = dict(inputs)
    pre = next(infer(PREPROCESSING, {TO_PREPROCESSING[k]: v for k, v in batched.items() if k in TO_PREPROCESSING},
                     False))
    trt_inputs = {PREPROCESSED[k]: v for k, v in pre.items() if k in PREPROCESSED}
    for name, target in TO_TENSORRT_LLM.items():
        if name in batched and (decoding_mode not in tree_decoding_modes() or name == "stream"):
            trt_inputs[target] = batched[name]
    stream = bool(_scalar(inputs, "stream", False))
    for response in infer(TENSORRT_LLM, trt_inputs, True):
        if "output_ids" not in response:
            continue
        text = next(infer(POSTPROCESSING, {"TOKENS_BATCH": response["output_ids"],
                                          "SEQUENCE_LENGTH": response["sequence_length"]}, False))["OUTPUT"]
        out = {"text_output": text.reshape(1, -1)}
        out.update({o.name: response[o.name].reshape(1, -1) for o in SPEC_OUTPUTS if o.name in response})
        yield out
        if not stream:
            return


# ---- the lossless verification stage -----------------------------------------------------------------------------


@dataclass(frozen=True)
class VerifySettings:
    """spectree_verify's config.pbtxt parameters (every key required, unknown keys rejected)."""

    engine_dir: str
    draft_method: str
    tree_choices: tuple[tuple[int, ...], ...]  # JSON list of choice paths in the config

    @classmethod
    def from_parameters(cls, params: Mapping[str, str], model: str) -> VerifySettings:
        return schema.load(cls, params, ConfigError, source=f"{model} config parameters", strings=True)


def verify_tree_logits(inputs: Mapping[str, np.ndarray], settings: VerifySettings) -> dict[str, np.ndarray]:
    """runtime.verify over the engine's tree logits, exactly as runtime.decode.SpecDecoder calls it for a Medusa /
    EAGLE draft: deterministic top-k children (Proposal.DETERMINISTIC: accept child x with probability p(x), on
    rejection zero it and renormalise), greedy at temperature 0, one torch.Generator seeded with random_seed.

    tree_logits [num_nodes, vocab] FP32 (row i: the target's logits at node i), draft_tokens [num_nodes] INT32
    (node 0: the root), optional tree_parents [num_nodes] (else the engine's static tree).
    """
    from runtime.protocol import Draft, Proposal
    from runtime.tree import Tree
    from runtime.verify import verify

    if "tree_logits" not in inputs or "draft_tokens" not in inputs:
        raise RequestError("tree_logits and draft_tokens are required")
    logits = torch.from_numpy(np.ascontiguousarray(inputs["tree_logits"], dtype=np.float32))  # [num_nodes, vocab]
    tokens = torch.from_numpy(inputs["draft_tokens"].reshape(-1).astype(np.int64))  # [num_nodes]
    if "tree_parents" in inputs:
        tree = tree_from_parents(inputs["tree_parents"].reshape(-1).tolist())
    else:
        if not settings.tree_choices:
            raise RequestError(f"tree_parents is required: the engine ({settings.draft_method}) has no static tree")
        tree = Tree.from_choices([list(c) for c in settings.tree_choices])
    if tokens.shape[0] != tree.num_nodes or logits.ndim != 2 or logits.shape[0] != tree.num_nodes:
        raise RequestError(f"draft_tokens {tuple(tokens.shape)} and tree_logits {tuple(logits.shape)} must both have "
                           f"the tree's {tree.num_nodes} nodes")
    params = sampling_params(*tensor_values(inputs, TRTLLM_FIELDS))
    verdict = verify(Draft(tree=tree, tokens=tokens, proposal=Proposal.DETERMINISTIC), logits, params,
                     params.new_generator())
    mode = "greedy" if params.greedy else f"rejection_sampling/{Proposal.DETERMINISTIC.value}"
    return {"accepted_path": verdict.path.numpy().astype(np.int32),
            "output_ids": verdict.tokens.numpy().astype(np.int32),
            "bonus": np.array([verdict.bonus]), "verification": np.array([mode.encode()], dtype=object)}


def tree_from_parents(parents: Sequence[int]):
    """The Tree whose node i has parent parents[i] (node 0 the root, parents[0] == -1, parents before children);
    nodes keep their order, siblings are ranked by index."""
    from runtime.tree import Tree

    if not parents or parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(parents) if i):
        raise RequestError(f"tree_parents {list(parents)}: node 0 must be the root (-1) and every other node's parent "
                           "must come before it")
    paths: list[list[int]] = [[]]
    children: dict[int, int] = {}
    for p in parents[1:]:
        rank = children.get(p, 0)
        children[p] = rank + 1
        paths.append(paths[p] + [rank])
    tree = Tree.from_choices(paths[1:])
    if [tuple(c) for c in tree.choices] != [tuple(p) for p in paths[1:]]:
        raise RequestError("tree_parents: nodes must be in canonical order (by depth, then rank), as drafts are sent")
    return tree


__all__ = [
    "ADAPTERS", "BACKENDS", "BLS", "ENSEMBLE", "MODELS", "POSTPROCESSING", "PREPROCESSING", "TEMPLATE_MODELS",
    "TENSORRT_LLM", "VERIFY", "EngineFacts", "RenderedTrtllmRepo", "TrtllmRepoOptions", "VerifySettings",
    "adapter_source", "bls_generate", "check_sampling", "choices_parameter", "decoding_mode_of", "model_configs",
    "parse_choices_parameter", "postprocess_batch", "preprocess_batch", "render_tensorrtllm", "tree_from_parents",
    "unset", "verify_tree_logits", "word_list",
]
