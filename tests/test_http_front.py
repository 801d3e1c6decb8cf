"""The HTTP front's request reading and response writing (deploy/http_front.py), without a server: every class of
client mistake tritonserver 2.51's own generate endpoint answered with a 500 (or let through) is a 400 naming the
field, the value and what was expected; valid requests become the model's tensors; responses are written as
tritonserver writes them. The front against a real tritonserver: tests/test_serving_faults.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from deploy.http_front import FrontError, InputSpec, ModelSpec, generate_inputs, parse_body, result_json
from model_repo.contract import ENSEMBLE_INPUTS, SPEC_DECODE_INPUTS

pytest.importorskip("tritonclient", reason="the HTTP front needs tritonclient (scripts/setup.sh)")


def spec(inputs, batched: bool) -> ModelSpec:
    """What get_model_config reports for one of the rendered models (dims as Triton's JSON gives them: strings)."""
    return ModelSpec.from_config({"max_batch_size": 8 if batched else 0, "input": [
        {"name": i.name, "data_type": i.data_type.name, "dims": [str(d) for d in i.dims]} for i in inputs]})


ENSEMBLE = spec(ENSEMBLE_INPUTS, batched=True)
SPEC_DECODE = spec(SPEC_DECODE_INPUTS, batched=False)


def test_valid_bodies_become_the_models_tensors():
    inputs, params = generate_inputs({"text_input": "hi", "max_tokens": 8, "temperature": 0.5, "seed": 2**64 - 1,
                                      "stream": True, "stop_words": ["a", "b"], "parameters": {"x": "y"}},
                                     ENSEMBLE, "ensemble")
    assert inputs["text_input"].tolist() == [[b"hi"]] and inputs["max_tokens"].dtype == np.int32
    assert inputs["max_tokens"].tolist() == [[8]] and inputs["seed"].tolist() == [[2**64 - 1]]
    assert inputs["seed"].dtype == np.uint64 and inputs["temperature"].dtype == np.float32
    assert inputs["stop_words"].tolist() == [[b"a", b"b"]] and inputs["stream"].tolist() == [[True]]
    assert params == {"x": "y"}
    # vllm_backend's shapes (no batch dimension); JSON-valued inputs may be given as JSON, or as its text.
    messages = [{"role": "user", "content": "hi"}]
    inputs, _ = generate_inputs({"messages": messages, "sampling_parameters": {"temperature": 0}}, SPEC_DECODE,
                                "spec_decode")
    assert json.loads(inputs["messages"][0]) == messages and inputs["messages"].shape == (1,)
    assert json.loads(inputs["sampling_parameters"][0]) == {"temperature": 0}
    inputs, _ = generate_inputs({"messages": json.dumps(messages), "text_input": ["x"]}, SPEC_DECODE, "spec_decode")
    assert json.loads(inputs["messages"][0]) == messages and inputs["text_input"].tolist() == [b"x"]
    assert generate_inputs({"text_input": "x", "max_tokens": None}, SPEC_DECODE, "spec_decode")[0].keys() == \
        {"text_input"}  # null: not given


@pytest.mark.parametrize("raw, message", [
    (b"{not json", "the request body is not valid JSON"),
    (b"hello", "the request body is not valid JSON"),  # e.g. sent as text/plain
    (b"", "the request body is not valid JSON"),
    (b"[1]", "the request body is a JSON list; expected a JSON object"),
    (b"\xff\xfe", "the request body is not UTF-8 text"),
    (b'{"max_tokens": NaN}', "NaN is not JSON"),
])
def test_bodies_that_are_not_json_objects(raw, message):
    with pytest.raises(FrontError) as e:
        parse_body(raw)
    assert e.value.status == 400 and message in str(e.value)


@pytest.mark.parametrize("body, message", [
    ({"text_input": "hi", "max_tokens": "abc"}, 'max_tokens: expected an integer in [-2147483648, 2147483647] '
                                                '(INT32), got "abc"'),
    ({"text_input": "hi", "max_tokens": "8"}, 'max_tokens: expected an integer in [-2147483648, 2147483647] (INT32), '
                                              'got "8"'),
    ({"text_input": "hi", "max_tokens": 1e9}, "max_tokens: expected an integer in [-2147483648, 2147483647] (INT32), "
                                              "got 1000000000.0"),
    ({"text_input": "hi", "max_tokens": 3_000_000_000}, "max_tokens: expected an integer in [-2147483648, 2147483647]"
                                                        " (INT32), got 3000000000"),  # tritonserver wrapped it
    ({"text_input": "hi", "max_tokens": True}, "max_tokens: expected an integer"),
    ({"text_input": "hi", "max_tokens": 8, "seed": 2**70}, "seed: expected an integer in [0, 18446744073709551615] "
                                                           "(UINT64), got 1180591620717411303424"),
    ({"text_input": "hi", "max_tokens": 8, "seed": -1}, "seed: expected an integer in [0, 18446744073709551615]"),
    ({"text_input": "hi", "max_tokens": 8, "temperature": "0.5"}, 'temperature: expected a number (FP32'),
    ({"text_input": "hi", "max_tokens": 8, "temperature": 1e39}, "temperature: expected a number (FP32, magnitude "
                                                                 "at most 3.403e+38), got 1e+39"),
    ({"text_input": "hi", "max_tokens": 8, "stream": 1}, "stream: expected true or false (BOOL), got 1"),
    ({"text_input": 5, "max_tokens": 8}, "text_input: expected a string (BYTES), got 5"),
    ({"text_input": ["a", "b"], "max_tokens": 8}, "text_input: expected one value (shape [1]), got 2"),
    ({"text_input": "hi", "stop_words": [["a"]]}, "stop_words: expected a value or a flat list of values, got a "
                                                  "nested list"),
    ({"text_input": "hi", "max_tokens": 8, "temprature": 0.5}, "unknown field(s) ['temprature']; ensemble takes"),
    ({"text_input": "hi", "parameters": [1]}, "parameters: expected an object of strings, numbers and booleans"),
    ({"text_input": "hi", "parameters": {"a": {"b": 1}}}, "parameters: expected an object of strings"),
    ({"text_input": "a\ud800b"}, "text_input: '\\ud800' at character 1 is a lone surrogate"),
    ({"text_input": "hi", "stop_words": ["ok", "\udfff"]}, "stop_words[1]: '\\udfff' at character 0"),
    ({"text_input": "hi", "sampling_parameters": {"stop": ["\ud800"]}}, "sampling_parameters.stop[0]: '\\ud800'"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content: '\\ud800'"),
    ({"text_input": "hi", "\ud800": 1}, "a field name: '\\ud800'"),
])
def test_client_mistakes_are_400s_naming_the_field(body, message):
    with pytest.raises(FrontError) as e:
        generate_inputs(json.loads(json.dumps(body)), ENSEMBLE, "ensemble")
    assert e.value.status == 400 and message in str(e.value), str(e.value)


def test_inputs_of_other_datatypes_are_named():
    model = ModelSpec(inputs={"x": InputSpec("x", "BF16", (1,))}, batched=False)
    with pytest.raises(FrontError, match="x: inputs of type BF16 are not taken over JSON here; use gRPC"):
        generate_inputs({"x": 1.0}, model, "m")


def test_responses_are_written_as_tritonserver_writes_them():
    out = result_json("ensemble", "1", {
        "text_output": np.array([["héllo\u0014".encode()]], dtype=np.object_),
        "output_ids": np.array([[42, 7]], dtype=np.int32), "tau": np.array([[1.5]], dtype=np.float32),
        "top_log_probs": np.array([[[-1.0, -float("inf")]]], dtype=np.float32),
        "batch_index": np.array([[0]], dtype=np.int32)})
    assert out.decode() == ('{"batch_index":0,"model_name":"ensemble","model_version":"1","output_ids":[42,7],'
                            '"tau":1.5,"text_output":"héllo\\u0014","top_log_probs":[-1.0,null]}')
