"""The one request contract (runtime/request_fields.py): every front end's table is the declaration's, and a value
out of a field's bounds is refused with the same message by the gRPC request parser, the OpenAI frontend, the
client's own check and vLLM's sampling_parameters (there under its key path)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from deploy.client import ClientError, build_inputs, check_sampling
from deploy.openai_api import APIError, ServedModel, chat_call, completion_call
from model_repo.contract import ENSEMBLE_INPUTS, NUMPY_DTYPES, REQUEST_INPUTS, SPEC_DECODE_INPUTS, field_inputs
from model_repo.model_config import DataType
from model_repo.request import RequestLimits, parse_generate_request
from model_repo.tensorrtllm import SAMPLING_CLIENT_INPUTS, SAMPLING_TRTLLM_INPUTS, TO_TENSORRT_LLM, VERIFY_INPUTS
from runtime.errors import RequestError
from runtime.request_fields import (
    FIELDS,
    ONE_VALUE_FIELDS,
    REQUEST_FIELDS,
    SAMPLING_FIELDS,
    VLLM_DEFAULTS,
    VLLM_KEYS,
    RequestField,
    SamplingParams,
    openai_fields,
    vllm_values,
)

SERVED = ServedModel(name="tiny", tokenizer=None, max_tokens_limit=1500, created=0)
LIMITS = RequestLimits(max_tokens=1500, vocab_size=100)


def test_sampling_params_is_the_declaration():
    """SamplingParams' fields are the declared sampling fields, with their types and defaults, and every one is
    checked on construction (a wrong type is refused naming the field)."""
    assert [f.name for f in dataclasses.fields(SamplingParams)] == [f.name for f in SAMPLING_FIELDS]
    defaults = SamplingParams()
    for field in SAMPLING_FIELDS:
        assert getattr(defaults, field.name) == field.default, field.name
        with pytest.raises(RequestError) as err:
            SamplingParams(**{field.name: object()})
        assert (err.value.field, err.value.expected) == (field.name, field.expected(defaults))
    assert set(FIELDS) == {f.name for f in REQUEST_FIELDS} and len(FIELDS) == len(REQUEST_FIELDS)


def test_triton_inputs_are_the_declared_tensors():
    declared = {name: (DataType(f.wire.tensor_type), (-1,) if f.listed else (1,))
                for f in REQUEST_FIELDS for name in f.wire.tensors}
    assert {i.name: (i.data_type, i.dims) for i in REQUEST_INPUTS} == declared
    for model_inputs in (ENSEMBLE_INPUTS, SPEC_DECODE_INPUTS):
        names = [i.name for i in model_inputs]
        assert set(declared) <= set(names) and len(names) == len(set(names))
    # the tensorrtllm backend's repository: the fields its tensorrt_llm model samples by
    trtllm = [f for f in REQUEST_FIELDS if f.wire.trtllm]
    assert [i.name for i in SAMPLING_TRTLLM_INPUTS] == [f.wire.trtllm for f in trtllm]
    assert [i.name for i in SAMPLING_CLIENT_INPUTS] == [f.wire.tensors[0] for f in trtllm]
    assert {k: v for k, v in TO_TENSORRT_LLM.items() if k != "stream"} == {f.wire.tensors[0]: f.wire.trtllm
                                                                             for f in trtllm}
    assert {i.name for f in trtllm for i in field_inputs(f)} <= {i.name for i in VERIFY_INPUTS}


def test_the_client_sends_every_declared_tensor():
    for field in REQUEST_FIELDS:
        if not field.wire.tensors or field.name == "max_tokens":
            with pytest.raises(TypeError, match=field.name):
                build_inputs("hi", 4, **{field.name: field.default})
            continue
        value = ["a"] if field.listed else (field.only or field.default or 1)
        sent = build_inputs("hi", 4, **{field.name: value})[-1]
        assert (sent.name(), sent.datatype()) == (field.wire.tensors[0], field.wire.tensor_type)


def test_vllm_keys_are_the_declared_fields():
    assert VLLM_KEYS == tuple(f.name for f in REQUEST_FIELDS if f.wire.vllm)
    with pytest.raises(RequestError) as err:
        parse_generate_request({"text_input": _text("hi"), "sampling_parameters": _text('{"bogus": 1}')}, LIMITS)
    assert str(err.value).endswith(f"accepted: {sorted(VLLM_KEYS)}")
    # every key is read (as text too, vllm_backend's clients' form), and what a request leaves out gets vLLM's default
    given = {"top_k": "5", "seed": "3", "max_tokens": "7", "stop": "x", "ignore_eos": "true", "n": "1"}
    r = parse_generate_request({"text_input": _text("hi"), "sampling_parameters": _text(json.dumps(given))}, LIMITS)
    assert (r.params.top_k, r.params.seed, r.params.max_tokens, r.params.stop, r.params.ignore_eos) == (
        5, 3, 7, ("x",), True)
    assert r.params.temperature == VLLM_DEFAULTS["temperature"]


@pytest.mark.parametrize("endpoint, make, base", [
    ("completions", completion_call, {"model": "tiny", "prompt": "x"}),
    ("chat", chat_call, {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}),
])
def test_openai_fields_are_the_declared_fields(endpoint, make, base):
    """Each endpoint takes the fields declared for it (at their defaults: accepted and sent to the server as vLLM's
    keys), and refuses the others as unknown."""
    fields = openai_fields(endpoint)
    body = {**base, **{f.name: f.only or f.default for f in fields if f.default is not None}}
    sent = json.loads(make(body, SERVED).inputs["sampling_parameters"][0])
    assert set(sent) >= {f.name for f in fields if f.default not in (None, ())}
    for field in REQUEST_FIELDS:
        if field not in fields and field.name != "logprobs":  # logprobs: each endpoint its own spelling
            with pytest.raises(APIError, match=f"unknown field.*{field.name}"):
                make({**base, field.name: field.default}, SERVED)


def _text(s: str) -> np.ndarray:
    return np.array([s.encode()], dtype=np.object_)


def _outside(field: RequestField) -> list:
    """Values just outside the field's declared bounds (and not one of vLLM's spellings of an allowed value)."""
    b, out = field.bounds, []
    if b.ge is not None:
        out.append(b.ge - 1 if b.ge - 1 not in dict(field.wire.spellings) else b.ge - 2)
    if b.gt is not None:
        out.append(b.gt)
    if b.le is not None:
        out.append(b.le + 1)
    if b.finite:
        out.append(math.inf)
    if field.at_most:
        out.append(9)  # the tests' requests ask for max_tokens 8
    return [type(field.default)(v) if field.default is not None else v for v in out]


# The scalar fields that a Triton input carries, with each value outside their bounds that the input's type can
# carry (an UINT64 seed cannot be negative nor above 2**64 - 1).
OUTSIDE = [(f, v) for f in SAMPLING_FIELDS if f.wire.tensors and not f.listed for v in _outside(f)
           if not (f.wire.tensor_type == "UINT64")]


def test_every_bounded_scalar_field_is_covered():
    assert {f.name for f, _ in OUTSIDE} == {"temperature", "top_k", "top_p", "max_tokens", "repetition_penalty",
                                            "presence_penalty", "frequency_penalty", "min_tokens", "logprobs"}


@pytest.mark.parametrize("field, value", OUTSIDE, ids=[f"{f.name}={v}" for f, v in OUTSIDE])
def test_a_value_out_of_bounds_gets_the_same_message_everywhere(field, value):
    """The gRPC request parser (the field's tensor), the client's check before sending, the OpenAI frontend and
    vLLM's sampling_parameters: one check, one message (vLLM's names its key path)."""
    tensor = field.wire.tensors[0]
    inputs = {"text_input": _text("hi"), "max_tokens": np.array([8], np.int32),
              tensor: np.array([value], dtype=NUMPY_DTYPES[DataType(field.wire.tensor_type)])}
    with pytest.raises(RequestError) as grpc:
        parse_generate_request(inputs, LIMITS)
    message = str(grpc.value)
    assert message == f"{tensor}: expected {field.expected(SamplingParams(max_tokens=8))}, got {value!r}"

    with pytest.raises(ClientError) as client:
        check_sampling(**{"max_tokens": 8, field.name: value})
    assert (str(client.value), client.value.code) == (message, "INVALID_ARG")

    sp = {"max_tokens": 8, field.name: value}
    with pytest.raises(RequestError) as vllm:
        parse_generate_request({"text_input": _text("hi"), "sampling_parameters": _text(json.dumps(sp))}, LIMITS)
    named = message.replace(f"{tensor}:", f"{field.name}:", 1)  # the field under its own name (vLLM's, OpenAI's)
    assert str(vllm.value) == f"sampling_parameters.{named}"

    if "completions" in field.wire.openai or field.name == "logprobs":  # completions' logprobs: vLLM's meaning
        with pytest.raises(APIError) as openai:
            completion_call({"model": "tiny", "prompt": "x", "max_tokens": 8, field.name: value}, SERVED)
        assert (str(openai.value), openai.value.param) == (named, field.name)


@pytest.mark.parametrize("field", ONE_VALUE_FIELDS, ids=lambda f: f.name)
def test_one_value_fields_are_refused_on_every_wire(field):
    """n, best_of, beam_width: this server generates one sequence per request, whichever wire asks for more."""
    for name in field.wire.tensors:
        with pytest.raises(RequestError, match=f"^{name}: 2; this server generates one sequence per request"):
            parse_generate_request({"text_input": _text("hi"), "max_tokens": np.array([8], np.int32),
                                    name: np.array([2], np.int32)}, LIMITS)
    if field.wire.vllm:
        with pytest.raises(RequestError, match=f"^sampling_parameters: {field.name} = 2; this server returns one"):
            vllm_values({field.name: 2}, "sampling_parameters")
        assert vllm_values({field.name: field.only}) == {}  # taken, and not a SamplingParams field
    for endpoint in field.wire.openai:
        make = completion_call if endpoint == "completions" else chat_call
        body = {"model": "tiny", "prompt": "x", "messages": [{"role": "user", "content": "x"}], field.name: 2}
        body.pop("messages" if endpoint == "completions" else "prompt")
        with pytest.raises(APIError, match=f"^{field.name}: 2; this server returns one sequence") as err:
            make(body, SERVED)
        assert err.value.param == field.name


def test_vllm_spellings_are_read_on_every_vllm_wire():
    """top_k -1 is vLLM's "off": in sampling_parameters, in request parameters and in OpenAI requests (where it is
    sent on as given); a Triton input has no such spelling."""
    assert vllm_values({"top_k": -1}) == {"top_k": 0}
    r = parse_generate_request({"text_input": _text("hi"), "sampling_parameters": _text('{"top_k": -1}')}, LIMITS)
    assert r.params.top_k == 0
    r = parse_generate_request({"text_input": _text("hi")}, LIMITS, parameters={"top_k": "-1", "max_tokens": 4})
    assert r.params.top_k == 0
    call = completion_call({"model": "tiny", "prompt": "x", "top_k": -1}, SERVED)
    assert json.loads(call.inputs["sampling_parameters"][0])["top_k"] == -1
    with pytest.raises(RequestError, match=r"^top_k: expected an integer >= 0 \(0 = off\), got -1$"):
        parse_generate_request({"text_input": _text("hi"), "max_tokens": np.array([8], np.int32),
                                "top_k": np.array([-1], np.int32)}, LIMITS)
