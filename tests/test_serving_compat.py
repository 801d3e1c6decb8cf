"""Clients users already have, against a real tritonserver serving a rendered repository (the `served` fixture of
tests/test_serving.py: one server for this module).

Requests are built exactly as the public clients build them:
  * NVIDIA's tensorrtllm_backend `inflight_batcher_llm/client/end_to_end_grpc_client.py` (prepare_inputs /
    run_inference: [[prompt]] tensors, beam_width, num_return_sequences, temperature, exclude_input_in_output
    always sent; penalties, stop/bad words, end_id / pad_id, return_log_probs when asked; --batch-inputs stacks
    prompts into one [batch, 1] request and reads batch_index; start_stream / async_stream_infer / stop_stream);
  * vllm_backend's `samples/client.py` (tritonclient.grpc.aio stream_infer over an async request iterator:
    text_input / stream / sampling_parameters (numbers as strings) / exclude_input_in_output, all [1], plus the
    same sampling parameters as request parameters), against spec_decode, the single-model entry point;
  * tensorrtllm_backend's README curl to the HTTP generate endpoint of the ensemble.
"""

from __future__ import annotations

import asyncio
import json
import queue
from functools import partial

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc", reason="serving tests need tritonclient[grpc] (scripts/setup.sh)")

from tests.test_serving import (  # noqa: E402
    PROMPTS,
    _a_lost_server_is_restarted,  # noqa: F401  (the autouse fixture)
    f32,
    offline,
    post,
    served,  # noqa: F401  (the fixture)
    settled_scrape,
)

# ---- end_to_end_grpc_client.py's request building (its prepare_inputs, kept to the shape it sends) ----------


def e2e_inputs(prompt, output_len, *, temperature=1.0, streaming=False, beam_width=1, num_return_sequences=1,
               repetition_penalty=None, presence_penalty=None, frequency_penalty=None, stop_words=(), bad_words=(),
               return_log_probs=False, end_id=None, pad_id=None, exclude_input_in_output=False, seed=None):
    input0 = [[prompt]]
    input0_data = np.array(input0).astype(object)
    output0_len = np.ones_like(input0).astype(np.int32) * output_len
    inputs = {
        "text_input": input0_data,
        "max_tokens": output0_len,
        "stream": np.array([[streaming]], dtype=bool),
        "beam_width": np.array([[beam_width]], dtype=np.int32),
        "temperature": np.array([[temperature]], dtype=np.float32),
    }
    if num_return_sequences is not None:
        inputs["num_return_sequences"] = np.array([[num_return_sequences]], dtype=np.int32)
    if bad_words:
        inputs["bad_words"] = np.array([list(bad_words)], dtype=object)
    if stop_words:
        inputs["stop_words"] = np.array([list(stop_words)], dtype=object)
    for name, value in (("repetition_penalty", repetition_penalty), ("presence_penalty", presence_penalty),
                        ("frequency_penalty", frequency_penalty)):
        if value is not None:
            inputs[name] = np.array([[value]], dtype=np.float32)
    if return_log_probs:
        inputs["return_log_probs"] = np.array([[True]], dtype=bool)
    if end_id is not None:
        inputs["end_id"] = np.array([[end_id]], dtype=np.int32)
    if pad_id is not None:
        inputs["pad_id"] = np.array([[pad_id]], dtype=np.int32)
    if exclude_input_in_output is not None:
        inputs["exclude_input_in_output"] = np.array([[exclude_input_in_output]], dtype=bool)
    if seed is not None:  # the client's --seed is not a flag, but `seed` is its ensemble's input name
        inputs["seed"] = np.array([[seed]], dtype=np.uint64)
    return inputs


def e2e_run(url, prompts, output_len, *, batch_inputs=False, streaming=False, return_log_probs=False,
            num_return_sequences=1, **kw):
    """run_inference's sending and parsing: texts per (batch row, sequence), errors, and the raw results."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException, np_to_triton_dtype

    def prepare_tensor(name, value):
        t = grpcclient.InferInput(name, value.shape, np_to_triton_dtype(value.dtype))
        t.set_data_from_numpy(value)
        return t

    bs1 = [e2e_inputs(p, output_len, streaming=streaming, return_log_probs=return_log_probs,
                      num_return_sequences=num_return_sequences, **kw) for p in prompts]
    if batch_inputs:
        multiple = [[prepare_tensor(k, np.concatenate([b[k] for b in bs1], axis=0)) for k in bs1[0]]]
    else:
        multiple = [[prepare_tensor(k, v) for k, v in b.items()] for b in bs1]
    outputs = [grpcclient.InferRequestedOutput("text_output")]
    if return_log_probs:
        outputs += [grpcclient.InferRequestedOutput("cum_log_probs"),
                    grpcclient.InferRequestedOutput("output_log_probs")]
    if batch_inputs:
        outputs.append(grpcclient.InferRequestedOutput("batch_index"))
    client = grpcclient.InferenceServerClient(url=url)
    texts, errors, results = [], [], []
    for inputs in multiple:
        completed: queue.Queue = queue.Queue()
        client.start_stream(callback=partial(lambda q, result, error: q.put(error or result), completed))
        batch_size = inputs[0].shape()[0]
        client.async_stream_infer("ensemble", inputs, outputs=outputs, request_id="")
        client.stop_stream()  # waits for the server to close the stream
        batch_text = [[""] for _ in range(batch_size)]
        while not completed.empty():
            result = completed.get()
            if isinstance(result, InferenceServerException):
                errors.append(result)
                continue
            results.append(result)
            output = result.as_numpy("text_output")
            batch_index = result.as_numpy("batch_index")
            batch_index = 0 if batch_index is None else batch_index[0][0]
            if streaming:
                batch_text[batch_index][0] += output[0].decode("utf-8")
            else:
                batch_text[batch_index][0] = output[0].decode("utf-8")
        texts.extend(t[0] for t in batch_text)
    client.close()
    return texts, errors, results


# ---- tensorrtllm_backend's client ------------------------------------------------------------------------


@pytest.mark.parametrize("streaming", [False, True])
def test_end_to_end_client_greedy(served, streaming):
    prompt = PROMPTS[0]
    ref = offline(served, prompt, max_tokens=24)
    texts, errors, results = e2e_run(served.grpc, [prompt], 24, streaming=streaming, temperature=0.0)
    assert not errors
    # Whole responses repeat the prompt (exclude_input_in_output false); streamed ones never do.
    assert texts == [ref.text if streaming else prompt + ref.text]
    assert len(results) > (2 if streaming else 0) and (streaming or len(results) == 1)


def test_end_to_end_client_sampled_with_penalties_and_log_probs(served):
    prompt = PROMPTS[1]
    kw = dict(temperature=0.8, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2)
    ref = offline(served, prompt, max_tokens=20, seed=11, logprobs=0,
                  **{k: f32(v) for k, v in kw.items()})
    texts, errors, results = e2e_run(served.grpc, [prompt], 20, streaming=True, return_log_probs=True, seed=11,
                                     **kw)
    assert not errors and texts == [ref.text]
    lps = np.concatenate([r.as_numpy("output_log_probs") for r in results], axis=-1)
    assert lps.shape == (1, 1, len(ref.token_ids))  # [batch, beam, tokens], as tensorrtllm_backend
    cum = results[-1].as_numpy("cum_log_probs")
    assert cum.shape == (1, 1) and float(cum[0, 0]) == pytest.approx(float(lps.sum()), abs=1e-3)
    assert all(x <= 0 for x in lps.reshape(-1))


def test_end_to_end_client_batch_inputs(served):
    prompts = [PROMPTS[0], PROMPTS[2]]
    refs = [offline(served, p, max_tokens=12) for p in prompts]
    texts, errors, results = e2e_run(served.grpc, prompts, 12, batch_inputs=True, streaming=True, temperature=0.0)
    assert not errors
    assert texts == [r.text for r in refs]
    assert {int(r.as_numpy("batch_index")[0][0]) for r in results} == {0, 1}


def test_end_to_end_client_stop_bad_words_and_end_id(served):
    prompt = PROMPTS[1]
    free = offline(served, prompt, max_tokens=30, ignore_eos=True)
    stop = free.text[6:9]
    ref = offline(served, prompt, max_tokens=30, stop=(stop,), stop_token_ids=(1,), ignore_eos=True)
    texts, errors, _ = e2e_run(served.grpc, [prompt], 30, temperature=0.0, stop_words=[stop], end_id=1, pad_id=1,
                               exclude_input_in_output=True)
    assert not errors and texts == [ref.text]
    tok = served.decoder.tokenizer
    bad = tok.decode(free.token_ids[:1])
    bad_ids = tuple(tok.encode(bad, add_bos=False, parse_special=False))
    ref = offline(served, prompt, max_tokens=10, bad_words=(bad_ids,))
    texts, errors, _ = e2e_run(served.grpc, [prompt], 10, temperature=0.0, bad_words=[bad],
                               exclude_input_in_output=True)
    assert not errors and texts == [ref.text]
    assert ref.token_ids[: len(bad_ids)] != bad_ids


@pytest.mark.parametrize("kw, message", [
    (dict(num_return_sequences=2), "num_return_sequences: 2; this server generates one sequence per request"),
    (dict(beam_width=3, num_return_sequences=None), "beam_width: 3; this server generates one sequence"),
])
def test_end_to_end_client_more_sequences_get_a_clear_error(served, kw, message):
    _, errors, _ = e2e_run(served.grpc, [PROMPTS[0]], 8, **kw)
    assert len(errors) == 1 and message in str(errors[0])


def test_readme_curl_to_the_ensemble_generate_endpoint(served):
    prompt = PROMPTS[3]
    ref = offline(served, prompt, max_tokens=16)
    code, body = post(f"{served.http}/v2/models/ensemble/generate",
                      {"text_input": prompt, "max_tokens": 16, "bad_words": "", "stop_words": ""})
    assert code == 200, body
    out = json.loads(body)
    assert out["text_output"] == prompt + ref.text and out["batch_index"] == 0


# ---- vllm_backend's sample client ------------------------------------------------------------------------


def vllm_run(url, model, prompts, sampling_parameters, streaming, exclude_input_in_output):
    """samples/client.py's LLMClient: create_request + stream_infer over an async request iterator."""
    import tritonclient.grpc.aio as grpcclient

    results: dict[str, list[bytes]] = {}
    errors: list = []

    def create_request(prompt, stream, request_id):
        inputs = []
        prompt_data = np.array([prompt.encode("utf-8")], dtype=np.object_)
        inputs.append(grpcclient.InferInput("text_input", [1], "BYTES"))
        inputs[-1].set_data_from_numpy(prompt_data)
        inputs.append(grpcclient.InferInput("stream", [1], "BOOL"))
        inputs[-1].set_data_from_numpy(np.array([stream], dtype=bool))
        data = np.array([json.dumps(sampling_parameters).encode("utf-8")], dtype=np.object_)
        inputs.append(grpcclient.InferInput("sampling_parameters", [1], "BYTES"))
        inputs[-1].set_data_from_numpy(data)
        inputs.append(grpcclient.InferInput("exclude_input_in_output", [1], "BOOL"))
        inputs[-1].set_data_from_numpy(np.array([exclude_input_in_output], dtype=bool))
        outputs = [grpcclient.InferRequestedOutput("text_output")]
        return {"model_name": model, "inputs": inputs, "outputs": outputs, "request_id": str(request_id),
                "parameters": sampling_parameters}

    async def requests():
        for i, prompt in enumerate(prompts):
            results[str(i)] = []
            yield create_request(prompt, streaming, i)

    async def main():
        client = grpcclient.InferenceServerClient(url=url)
        try:
            async for result, error in client.stream_infer(inputs_iterator=requests()):
                if error:
                    errors.append(error)
                else:
                    for i in result.as_numpy("text_output"):
                        results[result.get_response().id].append(i)
        finally:
            await client.close()

    asyncio.run(main())
    return {k: b"".join(v).decode("utf-8") for k, v in results.items()}, errors


def test_vllm_sample_client_request(served):
    """The sample's own sampling parameters (temperature "0.1", top_p "0.95", max_tokens "100"), prompts read
    from a file with readlines() (so ending in a newline), streaming and not."""
    prompts = [p + "\n" for p in PROMPTS[:2]]
    params = {"temperature": "0.1", "top_p": "0.95", "max_tokens": "100"}
    for streaming in (False, True):
        out, errors = vllm_run(served.grpc, "spec_decode", prompts, params, streaming, False)
        assert not errors
        assert all(out[str(i)].startswith(p) and len(out[str(i)]) > len(p) for i, p in enumerate(prompts))


def test_vllm_sample_client_greedy_equals_offline(served):
    prompts = [p + "\n" for p in PROMPTS[:3]]
    params = {"temperature": "0", "max_tokens": "24"}
    refs = [offline(served, p, max_tokens=24) for p in prompts]
    out, errors = vllm_run(served.grpc, "spec_decode", prompts, params, True, True)
    assert not errors and [out[str(i)] for i in range(3)] == [r.text for r in refs]
    out, errors = vllm_run(served.grpc, "spec_decode", prompts, {**params, "seed": "5", "temperature": "0.7"},
                           False, False)
    refs = [offline(served, p, max_tokens=24, temperature=0.7, seed=5) for p in prompts]
    assert not errors and [out[str(i)] for i in range(3)] == [p + r.text for p, r in zip(prompts, refs)]


def test_vllm_readme_curl_and_vllms_defaults(served):
    """vllm_backend's README request: the sampling settings as request parameters, no max_tokens (vLLM's default,
    16 tokens); and its sample client's sampling_parameters without a temperature sample at vLLM's 1.0."""
    prompt = PROMPTS[0]
    code, body = post(f"{served.http}/v2/models/spec_decode/generate",
                      {"text_input": prompt, "parameters": {"stream": False, "temperature": 0}})
    assert code == 200, body
    assert json.loads(body)["text_output"] == prompt + offline(served, prompt, max_tokens=16).text
    out, errors = vllm_run(served.grpc, "spec_decode", [prompt], {"seed": "5", "max_tokens": "12"}, False, True)
    assert not errors and out["0"] == offline(served, prompt, max_tokens=12, temperature=1.0, seed=5).text


# ---- metrics users' dashboards know ------------------------------------------------------------------------


def test_speculation_and_latency_metrics_on_the_metrics_port(served):
    before = settled_scrape(served)
    prompt = PROMPTS[0]
    ref = offline(served, prompt, max_tokens=30)
    texts, errors, results = e2e_run(served.grpc, [prompt], 30, streaming=True, temperature=0.0,
                                     exclude_input_in_output=True)
    assert not errors and texts == [ref.text]
    after = settled_scrape(served)

    def delta(name: str, **labels: str) -> float:
        return after.get(name, **labels) - before.get(name, **labels)

    lab = {"model": "spec_decode", "verification": "greedy"}
    st = ref.stats
    assert delta("spectree_verify_steps_total", **lab) == st.steps  # vLLM's num_drafts
    assert delta("spectree_draft_tokens_total", **lab) == st.draft_positions  # num_draft_tokens
    assert delta("spectree_accepted_tokens_total", **lab) == st.accepted_tokens  # num_accepted_tokens
    for position, n in enumerate(st.accepted_per_position, start=1):
        assert delta("spectree_accepted_tokens_per_position_total", position=str(position), **lab) == n
    assert delta("spectree_mean_accepted_length_count", **lab) == 1
    assert delta("spectree_mean_accepted_length_sum", **lab) == pytest.approx(st.mean_accepted_length)
    assert delta("spectree_time_to_first_token_seconds_count", model="spec_decode") == 1
    # the first response carries the prefill's token; every later token is one inter-token observation
    assert len(results) > 2
    assert delta("spectree_inter_token_latency_seconds_count", model="spec_decode") == len(ref.token_ids) - 1
    assert after.get("spectree_kv_cache_usage_ratio", model="spec_decode") == 0  # idle
    assert "spectree_queued_requests" in {n for n, _, _ in after.series}
