"""tensorrtllm_backend / vllm_backend request compatibility without a server: the rendered entry model's interface
against tensorrtllm_backend's published ensemble template, the extra inputs (seed, penalties, min_tokens, bad words,
log-probabilities, one-sequence checks), vLLM's string-valued sampling_parameters, and the batch dimension."""

from __future__ import annotations

import json

import numpy as np
import pytest

import runtime
from model_repo.contract import ENSEMBLE_OUTPUTS
from model_repo.generations import run_generation
from model_repo.metrics import SpecMetrics
from model_repo.render import RepoOptions, model_configs
from model_repo.request import RequestLimits, parse_generate_request, split_batch
from model_repo.responses import batch_row_outputs
from model_repo.model_config import DataType
from runtime.batching import SchedulerConfig
from runtime.errors import RequestError
from runtime.sampling import SamplingParams
from tests.heads import write_medusa_head
from tests.tiny import make_checkpoint, vocab_size

LIMITS = RequestLimits(max_tokens=100, vocab_size=vocab_size(), max_stop_words=4, max_stop_word_bytes=32)

# tensorrtllm_backend's inflight_batcher_llm/ensemble/config.pbtxt (NVIDIA/TensorRT-LLM
# triton_backend/all_models/inflight_batcher_llm/ensemble/config.pbtxt at 2a9abd95): name -> (type, dims) of the
# inputs and outputs a speculative decoder can honour. The entry model must declare exactly these.
TRTLLM_INPUTS = {
    "text_input": ("TYPE_STRING", (1,)), "max_tokens": ("TYPE_INT32", (1,)),
    "num_return_sequences": ("TYPE_INT32", (1,)), "bad_words": ("TYPE_STRING", (-1,)),
    "stop_words": ("TYPE_STRING", (-1,)), "exclude_input_in_output": ("TYPE_BOOL", (1,)),
    "end_id": ("TYPE_INT32", (1,)), "pad_id": ("TYPE_INT32", (1,)), "top_k": ("TYPE_INT32", (1,)),
    "top_p": ("TYPE_FP32", (1,)), "temperature": ("TYPE_FP32", (1,)), "repetition_penalty": ("TYPE_FP32", (1,)),
    "min_tokens": ("TYPE_INT32", (1,)), "presence_penalty": ("TYPE_FP32", (1,)),
    "frequency_penalty": ("TYPE_FP32", (1,)), "seed": ("TYPE_UINT64", (1,)), "return_log_probs": ("TYPE_BOOL", (1,)),
    "return_num_input_tokens": ("TYPE_BOOL", (1,)), "return_num_output_tokens": ("TYPE_BOOL", (1,)),
    "beam_width": ("TYPE_INT32", (1,)), "stream": ("TYPE_BOOL", (1,)),
}
TRTLLM_OUTPUTS = {
    "text_output": ("TYPE_STRING", (-1,)), "cum_log_probs": ("TYPE_FP32", (-1,)),
    "output_log_probs": ("TYPE_FP32", (-1, -1)), "batch_index": ("TYPE_INT32", (1,)),
    "sequence_index": ("TYPE_INT32", (1,)), "acceptance_rate": ("TYPE_FP32", (1,)),
    "total_accepted_draft_tokens": ("TYPE_INT32", (1,)), "total_draft_tokens": ("TYPE_INT32", (1,)),
    "num_input_tokens": ("TYPE_INT32", (1,)), "num_output_tokens": ("TYPE_INT32", (1,)),
}
# Older tensorrtllm_backend clients (random_seed, UINT64 [1]).
OLDER_INPUTS = {"random_seed": ("TYPE_UINT64", (1,))}


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    root = tmp_path_factory.mktemp("compat")
    ckpt = make_checkpoint(root / "llama2", "llama2", max_position_embeddings=128)
    heads = write_medusa_head(root / "medusa", 64, vocab_size(), num_heads=2)
    return runtime.load(ckpt, draft_model=heads, tree="[[0], [1], [0, 0]]")


def s(*texts: str) -> np.ndarray:
    return np.array([t.encode() for t in texts], dtype=np.object_)


def req(**inputs) -> dict[str, np.ndarray]:
    base = {"text_input": s("The quick brown fox"), "max_tokens": np.array([8], np.int32)}
    return {**base, **inputs}


def test_entry_model_declares_the_tensorrtllm_ensemble_interface(tmp_path):
    opts = RepoOptions(engine=str(tmp_path), output=str(tmp_path / "repo"), max_batch_size=16)
    ensemble = model_configs(opts, str(tmp_path), 128, 64)["ensemble"]
    assert ensemble.max_batch_size == 16
    inputs = {i.name: (i.data_type.name, i.dims) for i in ensemble.input}
    outputs = {o.name: (o.data_type.name, o.dims) for o in ensemble.output}
    for name, want in {**TRTLLM_INPUTS, **OLDER_INPUTS}.items():
        assert inputs.get(name) == want, name
    for name, want in TRTLLM_OUTPUTS.items():
        assert outputs.get(name) == want, name
    spec = model_configs(opts, str(tmp_path), 128, 64)["spec_decode"]
    assert spec.max_batch_size == 0  # vllm_backend's single-model shapes: text_input [1]


def test_tensorrtllm_inputs_become_sampling_params():
    r = parse_generate_request(req(
        seed=np.array([7], np.uint64), min_tokens=np.array([3], np.int32),
        repetition_penalty=np.array([1.2], np.float32), presence_penalty=np.array([0.5], np.float32),
        frequency_penalty=np.array([-0.25], np.float32), pad_id=np.array([0], np.int32),
        num_return_sequences=np.array([1], np.int32), beam_width=np.array([1], np.int32),
        return_log_probs=np.array([True]), return_num_input_tokens=np.array([True]),
        temperature=np.array([0.5], np.float32)), LIMITS)
    p = r.params
    assert (p.seed, p.min_tokens, p.presence_penalty, p.frequency_penalty) == (7, 3, 0.5, -0.25)
    assert p.repetition_penalty == pytest.approx(1.2) and p.logprobs == 0
    assert r.return_log_probs and r.return_num_input_tokens and not r.return_num_output_tokens


@pytest.mark.parametrize("inputs, message", [
    (dict(seed=np.array([1], np.uint64), random_seed=np.array([1], np.uint64)), "seed and random_seed: both given"),
    (dict(num_return_sequences=np.array([2], np.int32)), "num_return_sequences: 2; this server generates one"),
    (dict(beam_width=np.array([4], np.int32)), "beam_width: 4; this server generates one sequence"),
    (dict(pad_id=np.array([10**6], np.int32)), "pad_id: expected a token id in"),
    (dict(repetition_penalty=np.array([0.0], np.float32)), "repetition_penalty: expected a finite number > 0"),
    (dict(min_tokens=np.array([9], np.int32)), "min_tokens: expected an integer in [0, max_tokens=8], got 9"),
    (dict(num_top_log_probs=np.array([50], np.int32)),
     "num_top_log_probs: expected None or an integer in [0, 20], got 50"),
    (dict(bad_words=s("a", "b", "c", "d", "e")), "bad_words: 5 bad words; this server takes at most 4"),
    (dict(bad_words=s("x" * 40)), "bad_words[0]: 40 bytes; this server takes bad words of at most 32"),
    (dict(sampling_parameters=s(json.dumps({"n": 3}))), "n = 3; this server returns one sequence"),
    (dict(sampling_parameters=s(json.dumps({"temperature": "warm"}))), "temperature = 'warm' is not a float"),
    (dict(sampling_parameters=s(json.dumps({"ignore_eos": "maybe"}))), "ignore_eos = 'maybe' is not a bool"),
    (dict(sampling_parameters=s(json.dumps({"min_tokens": 2})), min_tokens=np.array([2], np.int32)),
     "'min_tokens' is also given as the input 'min_tokens'"),
])
def test_bad_compat_inputs_name_the_input(decoder, inputs, message):
    with pytest.raises(RequestError) as err:
        parse_generate_request(req(**inputs), LIMITS, decoder.tokenizer)
    assert message in str(err.value)


def test_vllm_sample_client_sends_numbers_as_strings():
    """vllm_backend's samples/client.py: {"temperature": "0.1", "top_p": "0.95", "max_tokens": "100"}."""
    sp = {"temperature": "0.1", "top_p": "0.95", "max_tokens": "100"}
    r = parse_generate_request({"text_input": s("Hello"), "stream": np.array([True]),
                                "sampling_parameters": s(json.dumps(sp)),
                                "exclude_input_in_output": np.array([False])},
                               RequestLimits(max_tokens=128, vocab_size=vocab_size()))
    assert (r.params.temperature, r.params.top_p, r.params.max_tokens) == (0.1, 0.95, 100)
    assert r.stream and r.echo == "Hello"  # vLLM echoes the prompt in the first streamed delta
    r = parse_generate_request(req(sampling_parameters=s(json.dumps(
        {"ignore_eos": "true", "presence_penalty": "1.5", "logprobs": "2", "n": "1"}))), LIMITS)
    assert r.params.ignore_eos and r.params.presence_penalty == 1.5 and r.top_log_probs == 2 and r.return_log_probs


def test_bad_words_are_encoded_like_tensorrtllm_preprocessing(decoder):
    tok = decoder.tokenizer
    r = parse_generate_request(req(bad_words=s(" fox", "", " lazy dog")), LIMITS, tok)
    assert r.params.bad_words == (tuple(tok.encode(" fox", add_bos=False, parse_special=False)),
                                  tuple(tok.encode(" lazy dog", add_bos=False, parse_special=False)))
    with pytest.raises(RequestError, match="bad_words: this model has no tokenizer"):
        parse_generate_request(req(bad_words=s("x")), LIMITS)


def test_bad_words_never_appear_in_the_output(decoder):
    tok = decoder.tokenizer
    free = decoder.generate("The quick brown fox", max_tokens=12, ignore_eos=True).token_ids
    # a two-token window of the free output whose text encodes back to exactly those tokens
    i = next(i for i in range(1, len(free) - 1)
             if tuple(tok.encode(tok.decode(free[i:i + 2]), add_bos=False, parse_special=False)) == free[i:i + 2])
    seq = free[i:i + 2]
    greedy_to_the_end = s(json.dumps({"ignore_eos": True, "temperature": 0}))
    r = parse_generate_request(req(bad_words=s(tok.decode(seq)), max_tokens=np.array([12], np.int32),
                                   sampling_parameters=greedy_to_the_end), LIMITS, tok)
    assert r.params.bad_words == (seq,)
    out = decoder.generate("The quick brown fox", r.params).token_ids
    assert all(tuple(out[k:k + 2]) != seq for k in range(len(out)))
    assert out[:i + 1] == free[:i + 1] and out[i + 1] != free[i + 1]  # only the banned continuation changed


class ListSink:
    def __init__(self) -> None:
        self.sent: list[tuple[dict, bool]] = []

    def send(self, outputs, final):
        self.sent.append((outputs, final))

    def fail(self, exc):
        raise exc

    def is_cancelled(self):
        return False


def test_log_probs_and_counts_in_responses(decoder):
    r = parse_generate_request(req(stream=np.array([True]), max_tokens=np.array([10], np.int32),
                                   temperature=np.array([0.8], np.float32), seed=np.array([3], np.uint64),
                                   return_log_probs=np.array([True]), num_top_log_probs=np.array([3], np.int32),
                                   return_num_input_tokens=np.array([True]),
                                   return_num_output_tokens=np.array([True])), LIMITS)
    sink = ListSink()
    final = run_generation(decoder, r, sink)
    ref = decoder.generate("The quick brown fox", SamplingParams(max_tokens=10, temperature=0.8, seed=3, logprobs=3))
    ids = [int(t) for out, _ in sink.sent for t in out["output_ids"]]
    lps = [float(x) for out, _ in sink.sent for x in out["output_log_probs"]]
    assert ids == list(ref.token_ids) and len(lps) == 10
    assert float(sink.sent[-1][0]["cum_log_probs"][0]) == pytest.approx(sum(lps), abs=1e-4)
    for out, _ in sink.sent:
        n = len(out["output_ids"])
        assert out["num_output_tokens"].tolist() == [n] and out["top_log_probs"].shape == (n, 3)
        assert out["top_log_probs_ids"].shape == (n, 3) and out["num_input_tokens"][0] > 0
        assert np.all(out["top_log_probs"][:, 0] >= out["output_log_probs"] - 1e-6)
    last = sink.sent[-1][0]
    st = final.stats
    assert float(last["acceptance_rate"][0]) == pytest.approx(st.acceptance_rate)
    assert int(last["total_draft_tokens"][0]) == st.draft_positions
    assert int(last["total_accepted_draft_tokens"][0]) == st.accepted_tokens


def test_no_extra_outputs_unless_asked(decoder):
    sink = ListSink()
    run_generation(decoder, parse_generate_request(req(), LIMITS), sink)
    (out, final), = sink.sent
    assert final and not {"cum_log_probs", "output_log_probs", "top_log_probs", "num_input_tokens"} & set(out)


def test_split_batch_and_row_outputs():
    rows = split_batch({"text_input": np.array([[b"a"], [b"b"]], dtype=object),
                                 "max_tokens": np.array([[4], [5]], np.int32),
                                 "stream": np.array([[True], [False]]),
                                 "exclude_input_in_output": np.array([[False], [False]]),
                                 "stop_words": np.array([[b"x", b""], [b"y", b"z"]], dtype=object)})
    assert [r["text_input"].tolist() for r in rows] == [[b"a"], [b"b"]]
    assert rows[1]["stop_words"].tolist() == [b"y", b"z"] and rows[1]["max_tokens"].shape == (1,)
    # a streamed row never repeats the prompt (tensorrtllm_backend), a whole one keeps the client's choice
    assert rows[0]["exclude_input_in_output"].tolist() == [True]
    assert rows[1]["exclude_input_in_output"].tolist() == [False]
    with pytest.raises(RequestError, match=r"text_input: shape \[1\]; this model batches"):
        split_batch({"text_input": np.array([b"a"], dtype=object)})
    with pytest.raises(RequestError, match="max_tokens: batch size 2, but other inputs have 1"):
        split_batch({"text_input": np.array([[b"a"]], dtype=object),
                              "max_tokens": np.array([[1], [2]], np.int32)})
    out = batch_row_outputs({"text_output": s("hi"), "output_ids": np.array([1, 2], np.int32),
                                      "cum_log_probs": np.array([-1.5], np.float32),
                                      "output_log_probs": np.array([-1.0, -0.5], np.float32)}, 3)
    assert out["text_output"].shape == (1,)  # as tensorrtllm_backend's postprocessing sends it
    assert out["output_ids"].shape == (1, 2) and out["cum_log_probs"].shape == (1, 1)
    assert out["output_log_probs"].shape == (1, 1, 2)
    assert out["batch_index"].tolist() == [[3]] and out["sequence_index"].tolist() == [[0]]
    assert {o.name for o in ENSEMBLE_OUTPUTS} >= set(out)
    assert all(o.data_type is not DataType.TYPE_BOOL for o in ENSEMBLE_OUTPUTS)


class RecordingBackend:
    def __init__(self):
        self.values: dict = {}
        self.observations: dict = {}

    def add(self, spec, labels, value):
        key = (spec.name, tuple(sorted(labels.items())))
        self.values[key] = self.values.get(key, 0) + value

    def set(self, spec, labels, value):
        self.values[(spec.name, tuple(sorted(labels.items())))] = value

    def observe(self, spec, labels, value):
        self.observations.setdefault((spec.name, tuple(sorted(labels.items()))), []).append(value)


def test_speculation_and_latency_metrics(decoder):
    """vLLM's spec-decode counters, per-position acceptance, TTFT / inter-token latency, KV usage."""
    backend = RecordingBackend()
    metrics = SpecMetrics(backend, "spec_decode", "spec_decode_0")
    metrics.limits(SchedulerConfig(max_concurrent_requests=2, max_queue_size=3, kv_budget_bytes=1000))
    metrics.state(1, 2, 250)
    r = parse_generate_request(req(stream=np.array([True]), max_tokens=np.array([20], np.int32),
                                   sampling_parameters=s(json.dumps({"ignore_eos": True, "temperature": 0}))), LIMITS)
    sink = ListSink()
    final = run_generation(decoder, r, sink)
    metrics.finished(None, final, r.timing)
    st = final.stats
    lab = (("model", "spec_decode"), ("verification", "greedy"))
    v, o = backend.values, backend.observations
    assert v[("spectree_verify_steps_total", lab)] == st.steps > 0
    assert v[("spectree_draft_tokens_total", lab)] == st.draft_positions
    assert v[("spectree_tree_nodes_total", lab)] == st.drafted_tokens
    assert v[("spectree_accepted_tokens_total", lab)] == st.accepted_tokens
    per_pos = {dict(k[1])["position"]: n for k, n in v.items() if k[0] == "spectree_accepted_tokens_per_position_total"}
    assert per_pos == {str(i + 1): n for i, n in enumerate(st.accepted_per_position)}
    assert o[("spectree_mean_accepted_length", lab)] == [pytest.approx(st.mean_accepted_length)]
    assert o[("spectree_acceptance_rate", lab)] == [pytest.approx(st.acceptance_rate)]
    ttft = o[("spectree_time_to_first_token_seconds", (("model", "spec_decode"),))]
    itl = o[("spectree_inter_token_latency_seconds", (("model", "spec_decode"),))]
    assert len(ttft) == 1 and ttft[0] > 0
    assert len(itl) == 20 - len(sink.sent[0][0]["output_ids"])  # one per token after the first response
    inst = (("instance", "spec_decode_0"), ("model", "spec_decode"))
    assert v[("spectree_kv_cache_usage_ratio", inst)] == 0.25 and v[("spectree_queued_requests", inst)] == 2
