"""The served models' I/O contract: every input and output of preprocessing, spec_decode and the ensemble (entry)
model, declared once (model_repo.model_config types; model_repo.render writes them into config.pbtxt, model_repo.request
reads requests by them, model_repo.responses writes responses by them). The inputs of the request contract's fields
(max_tokens, the sampling settings) are made from its declaration, runtime.request_fields.

The interface follows the Triton LLM conventions of tensorrtllm_backend / vllm_backend (reference-facts section 8),
so their clients work unchanged:

    inputs   text_input STRING [1] or messages STRING [1] (a JSON array of {role, content}, OpenAI chat form,
             rendered by the model's chat template; exactly one of the two), max_tokens INT32 [1] (required);
             optional stream BOOL, temperature FP32, top_k INT32, top_p FP32, seed / random_seed UINT64,
             stop_words / bad_words STRING [-1], end_id INT32, exclude_input_in_output BOOL, sampling_parameters
             STRING (vLLM-style JSON), parse_special_tokens BOOL (special-token text in text_input or in message
             content becomes special tokens; default: literal text); tensorrtllm_backend's min_tokens, repetition /
             presence / frequency penalties, pad_id, beam_width and num_return_sequences (1), return_log_probs,
             return_num_input_tokens / ..._output_tokens. The entry model adds a batch dimension
             (request.split_batch / responses.batch_row_outputs).
    outputs  text_output STRING [-1]: the DELTA text of each streamed response (the whole text when not
             streaming); optional output_ids INT32 [-1] (the delta's token ids) and, on the final response,
             finish_reason, verification (the lossless verification mode this request ran: "greedy" at
             temperature 0, "rejection_sampling/<proposal>" otherwise), tau and accepted_per_step, plus
             tensorrtllm_backend's cum_log_probs / output_log_probs, acceptance_rate,
             total_accepted_draft_tokens, total_draft_tokens, num_input_tokens / num_output_tokens.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from model_repo.model_config import DataType, ModelInput, ModelOutput
from runtime.request_fields import REQUEST_FIELDS, RequestField

# Every input is declared optional, text_input and max_tokens included, and the models enforce what is
# required with an error naming the input. Measured on tritonserver 2.51: the gRPC streaming path does not
# check required inputs, and an ensemble missing a required input ends with an empty final response and no
# error at all, so a config-level `optional: false` would turn a bad request into a silent empty answer.
TEXT_INPUT = ModelInput("text_input", DataType.TYPE_STRING, (1,), optional=True)
MESSAGES = ModelInput("messages", DataType.TYPE_STRING, (1,), optional=True)  # JSON [{"role", "content"}, ...]
INPUT_IDS = ModelInput("input_ids", DataType.TYPE_INT32, (-1,), optional=True)
# Special-token text typed in a prompt ("<s>", "</s>", "<|im_start|>"), in text_input or in a message's content, is
# literal text unless the request sets this true (a chat template's own special tokens are always parsed).
PARSE_SPECIAL_TOKENS = ModelInput("parse_special_tokens", DataType.TYPE_BOOL, (1,), optional=True)


def field_inputs(field: RequestField) -> tuple[ModelInput, ...]:
    """The Triton inputs that carry a field of the request contract (runtime.request_fields)."""
    dims = (-1,) if field.listed else (1,)
    return tuple(ModelInput(name, DataType(field.wire.tensor_type), dims, optional=True) for name in field.wire.tensors)


# The request contract's fields as Triton inputs (tensorrtllm_backend's names, types and dims; `random_seed`, its
# older name for `seed`, stays for older clients): max_tokens, the sampling settings, num_return_sequences and
# beam_width (1), and num_top_log_probs (ours: the likeliest alternatives of every emitted token, as the OpenAI
# frontend's logprobs need).
REQUEST_INPUTS: tuple[ModelInput, ...] = tuple(i for f in REQUEST_FIELDS for i in field_inputs(f))
MAX_TOKENS = next(i for i in REQUEST_INPUTS if i.name == "max_tokens")
OPTIONAL_INPUTS: tuple[ModelInput, ...] = (
    ModelInput("stream", DataType.TYPE_BOOL, (1,), optional=True),
    *(i for i in REQUEST_INPUTS if i is not MAX_TOKENS),
    ModelInput("end_id", DataType.TYPE_INT32, (1,), optional=True),
    ModelInput("exclude_input_in_output", DataType.TYPE_BOOL, (1,), optional=True),
    ModelInput("sampling_parameters", DataType.TYPE_STRING, (1,), optional=True),
    PARSE_SPECIAL_TOKENS,
    # tensorrtllm_backend's ensemble inputs beyond the request contract's (its names, types and dims)
    ModelInput("pad_id", DataType.TYPE_INT32, (1,), optional=True),
    ModelInput("return_log_probs", DataType.TYPE_BOOL, (1,), optional=True),
    ModelInput("return_num_input_tokens", DataType.TYPE_BOOL, (1,), optional=True),
    ModelInput("return_num_output_tokens", DataType.TYPE_BOOL, (1,), optional=True),
)
# What the ensemble takes from clients.
ENSEMBLE_INPUTS: tuple[ModelInput, ...] = (TEXT_INPUT, MAX_TOKENS, MESSAGES, *OPTIONAL_INPUTS)
# spec_decode takes the prompt as text or messages, as token ids (from the preprocessing stage), or ids with the
# text or messages they came from (ids are decoded; text is only echoed when exclude_input_in_output is false).
SPEC_DECODE_INPUTS: tuple[ModelInput, ...] = (TEXT_INPUT, INPUT_IDS, MAX_TOKENS, MESSAGES, *OPTIONAL_INPUTS)
PREPROCESSING_INPUTS: tuple[ModelInput, ...] = (TEXT_INPUT, MESSAGES, PARSE_SPECIAL_TOKENS)
PREPROCESSING_OUTPUTS: tuple[ModelOutput, ...] = (
    ModelOutput("input_ids", DataType.TYPE_INT32, (-1,)),
    ModelOutput("input_length", DataType.TYPE_INT32, (1,)),
)
TEXT_OUTPUT = ModelOutput("text_output", DataType.TYPE_STRING, (-1,))
SPEC_DECODE_OUTPUTS: tuple[ModelOutput, ...] = (
    TEXT_OUTPUT,
    ModelOutput("output_ids", DataType.TYPE_INT32, (-1,)),
    ModelOutput("finish_reason", DataType.TYPE_STRING, (1,)),  # final response only
    ModelOutput("verification", DataType.TYPE_STRING, (1,)),  # final response only
    ModelOutput("tau", DataType.TYPE_FP32, (1,)),  # final response only
    ModelOutput("accepted_per_step", DataType.TYPE_INT32, (-1,)),  # final response only
    # tensorrtllm_backend's names: log-probabilities (return_log_probs: of this response's tokens, and the running
    # sum), its speculative-decoding statistics (final response; acceptance_rate = accepted draft tokens / draft
    # positions, see runtime.decode) and token counts (return_num_input_tokens / return_num_output_tokens).
    ModelOutput("cum_log_probs", DataType.TYPE_FP32, (1,)),
    ModelOutput("output_log_probs", DataType.TYPE_FP32, (-1,)),
    ModelOutput("acceptance_rate", DataType.TYPE_FP32, (1,)),  # final response only
    ModelOutput("total_accepted_draft_tokens", DataType.TYPE_INT32, (1,)),  # final response only
    ModelOutput("total_draft_tokens", DataType.TYPE_INT32, (1,)),  # final response only
    ModelOutput("num_input_tokens", DataType.TYPE_INT32, (1,)),
    ModelOutput("num_output_tokens", DataType.TYPE_INT32, (1,)),  # tokens in this response
    # num_top_log_probs = k: [tokens, k] likeliest alternatives per token (ids -1 / log-probs -inf past the end)
    ModelOutput("top_log_probs", DataType.TYPE_FP32, (-1, -1)),
    ModelOutput("top_log_probs_ids", DataType.TYPE_INT32, (-1, -1)),
)

# The verification stage as recorded in spec_decode's config.pbtxt: the rule runtime.verify applies.
VERIFICATION_GREEDY = "greedy"  # temperature == 0: longest draft path equal to the target's argmax
VERIFICATION_SAMPLED = "rejection_sampling"  # temperature > 0: lossless tree rejection sampling


# numpy dtype of each wire type (what a request's arrays must hold; STRING: bytes, str or object arrays)
NUMPY_DTYPES = {
    DataType.TYPE_BOOL: np.dtype(np.bool_),
    DataType.TYPE_INT32: np.dtype(np.int32),
    DataType.TYPE_UINT64: np.dtype(np.uint64),
    DataType.TYPE_FP32: np.dtype(np.float32),
    DataType.TYPE_STRING: np.dtype(np.object_),
}


Inputs = Mapping[str, np.ndarray]  # a request's inputs: name -> array


# ---- the ensemble's batch dimension (tensorrtllm_backend's shapes) --------------------------------------
#
# The entry model has max_batch_size > 0 like tensorrtllm_backend's ensemble: clients send [batch, 1] tensors
# (NVIDIA's end_to_end_grpc_client.py sends [[prompt]]), and each row becomes one spec_decode request (whose
# inputs are the same tensors without the batch dimension, vllm_backend's shapes).

BATCH_INDEX = ModelOutput("batch_index", DataType.TYPE_INT32, (1,))
SEQUENCE_INDEX = ModelOutput("sequence_index", DataType.TYPE_INT32, (1,))
# Dims as tensorrtllm_backend's ensemble declares them: log-probabilities carry a beam dimension.
_ENSEMBLE_DIMS = {"cum_log_probs": (-1,), "output_log_probs": (-1, -1)}
ENSEMBLE_OUTPUTS: tuple[ModelOutput, ...] = (
    *(ModelOutput(o.name, o.data_type, _ENSEMBLE_DIMS.get(o.name, o.dims)) for o in SPEC_DECODE_OUTPUTS),
    BATCH_INDEX,
    SEQUENCE_INDEX,
)


__all__ = [
    "TEXT_INPUT",
    "MESSAGES",
    "INPUT_IDS",
    "MAX_TOKENS",
    "PARSE_SPECIAL_TOKENS",
    "REQUEST_INPUTS",
    "OPTIONAL_INPUTS",
    "ENSEMBLE_INPUTS",
    "SPEC_DECODE_INPUTS",
    "PREPROCESSING_INPUTS",
    "PREPROCESSING_OUTPUTS",
    "TEXT_OUTPUT",
    "SPEC_DECODE_OUTPUTS",
    "VERIFICATION_GREEDY",
    "VERIFICATION_SAMPLED",
    "NUMPY_DTYPES",
    "Inputs",
    "field_inputs",
    "BATCH_INDEX",
    "SEQUENCE_INDEX",
    "ENSEMBLE_OUTPUTS",
]
