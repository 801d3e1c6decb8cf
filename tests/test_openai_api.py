"""The OpenAI-compatible API (deploy/openai_api.py): request translation without a server, then the official
`openai` Python client against `python -m deploy serve --openai-port` (tritonserver + uvicorn, the `served`
fixture of tests/test_serving.py): streamed and whole chat / completions equal the offline runtime (greedy: the
same text as `python -m runtime generate --chat`), log-probabilities, usage with the speculation statistics,
errors in OpenAI's shape, 16 concurrent streams, and a dropped stream cancelling its generation."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from deploy.openai_api import APIError, ServedModel, chat_call, completion_call

SERVED = ServedModel(name="tiny", tokenizer=None, max_tokens_limit=1500, created=0)


# ---- request translation (no server) ----------------------------------------------------------------------


def sampling(call) -> dict:
    return json.loads(call.inputs["sampling_parameters"][0])


def test_completion_request_becomes_triton_inputs():
    call = completion_call({"model": "tiny", "prompt": "Hello", "max_tokens": 5, "temperature": 0, "seed": 3,
                            "stop": "\n", "logprobs": 2, "top_k": 4, "min_tokens": 1, "user": "x"}, SERVED)
    assert call.inputs["text_input"].tolist() == [b"Hello"] and call.inputs["stream"].tolist() == [True]
    assert sampling(call) == {"max_tokens": 5, "temperature": 0, "seed": 3, "top_k": 4, "min_tokens": 1,
                              "stop": ["\n"], "logprobs": 2}
    assert call.logprobs and call.top_logprobs == 2 and not call.stream
    call = completion_call({"model": "tiny", "prompt": [5, 6, 7]}, SERVED)
    assert call.inputs["input_ids"].tolist() == [5, 6, 7] and call.inputs["input_ids"].dtype == np.int32
    assert sampling(call) == {"max_tokens": 16, "temperature": 1.0}  # OpenAI's defaults
    call = completion_call({"model": "tiny", "prompt": ["Hi"], "echo": True, "stream": True,
                            "stream_options": {"include_usage": True}}, SERVED)
    assert call.echo == "Hi" and call.include_usage


def test_chat_request_becomes_triton_inputs():
    call = chat_call({"model": "tiny", "messages": [{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                      "logprobs": True, "top_logprobs": 3, "max_completion_tokens": 7, "stream": True}, SERVED)
    assert json.loads(call.inputs["messages"][0]) == [{"role": "system", "content": "Be brief."},
                                                      {"role": "user", "content": "Hi"}]
    assert sampling(call)["max_tokens"] == 7 and sampling(call)["logprobs"] == 3
    call = chat_call({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}, SERVED)
    assert sampling(call)["max_tokens"] == 1500 and "logprobs" not in sampling(call)  # the server's limit


@pytest.mark.parametrize("make, body, status, message", [
    (chat_call, {"model": "other", "messages": [{"role": "user", "content": "x"}]}, 404, "'other' does not exist"),
    (chat_call, {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n: 2"),
    (chat_call, {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     400, "tools: not supported"),
    (chat_call, {"model": "tiny", "messages": []}, 400, "messages: expected a non-empty list"),
    (chat_call, {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs: needs logprobs: true"),
    (chat_call, {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "only text content parts"),
    (completion_call, {"model": "tiny", "prompt": "x", "logprobs": 50}, 400,
     "logprobs: expected None or an integer in [0, 20], got 50"),
    (chat_call, {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": True,
                 "top_logprobs": 50}, 400, "top_logprobs: expected None or an integer in [0, 20], got 50"),
    (chat_call, {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, 400,
     "max_completion_tokens: expected an integer >= 1, got 0"),
    (completion_call, {"model": "tiny", "prompt": "x", "min_tokens": 20}, 400,
     "min_tokens: expected an integer in [0, max_tokens=16], got 20"),
    (completion_call, {"model": "tiny", "prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options: only allowed with stream: true"),
    (completion_call, {"model": "tiny", "prompt": ["a", "b"]}, 400, "a batch of 2 prompts"),
    (completion_call, {"model": "tiny", "prompt": "x", "temprature": 1}, 400, "unknown field(s) ['temprature']"),
    (completion_call, {"model": "tiny", "prompt": "x", "logit_bias": {"5": 10}}, 400, "logit_bias: not supported"),
    (completion_call, {"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens: expected an integer >= 1"),
    (completion_call, {"model": "tiny", "prompt": "x", "temperature": "hot"}, 400,
     "temperature: expected a finite number >= 0 (0 = greedy), got 'hot'"),
    (completion_call, {"model": "tiny"}, 400, "prompt: expected a non-empty string"),
])
def test_bad_requests_are_refused_in_openai_shape(make, body, status, message):
    with pytest.raises(APIError) as err:
        make(body, SERVED)
    assert err.value.status == status and message in str(err.value)
    assert err.value.body()["error"]["message"] == str(err.value)


@pytest.mark.parametrize("make, body, message", [
    (completion_call, {"model": "tiny", "prompt": "a\ud800"}, "prompt: '\\ud800' at character 1 is a lone surrogate"),
    (completion_call, {"model": "tiny", "prompt": "a", "stop": ["x", "\udfff"]}, "stop[1]: '\\udfff' at character 0"),
    (chat_call, {"model": "tiny", "messages": [{"role": "user", "content": "\ud800"}]},
     "messages[0].content: '\\ud800' at character 0 is a lone surrogate"),
    (chat_call, {"model": "tiny", "messages": [{"role": "us\ud800er", "content": "x"}]}, "messages[0].role: "),
    (chat_call, {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages[0].content[0].text: "),
    (completion_call, {"model": "tiny", "prompt": "a", "\ud800": 1}, "a field name: '\\ud800'"),
])
def test_lone_surrogates_are_refused_naming_the_field(make, body, message):
    """JSON can escape half a UTF-16 pair ("\\ud800"); no UTF-8 text holds one, so it is a 400 naming where it is,
    before anything encodes it (it used to be a 500 with a UnicodeEncodeError traceback)."""
    with pytest.raises(APIError) as err:
        make(json.loads(json.dumps(body)), SERVED)
    assert err.value.status == 400 and message in str(err.value), str(err.value)
    assert "expected valid Unicode text" in str(err.value)


def test_sampling_errors_are_sampling_params_errors_named_by_the_request_field():
    from runtime.errors import RequestError
    from runtime.sampling import SamplingParams

    with pytest.raises(RequestError) as own:
        SamplingParams(top_p=1.5)
    with pytest.raises(APIError) as err:
        completion_call({"model": "tiny", "prompt": "x", "top_p": 1.5}, SERVED)
    assert str(err.value) == f"top_p: expected {own.value.expected}, got 1.5" and err.value.param == "top_p"
    assert sampling(completion_call({"model": "tiny", "prompt": "x", "top_k": -1}, SERVED))["top_k"] == -1  # vLLM: off


# ---- the official openai client against a real server ------------------------------------------------------

pytest.importorskip("tritonclient.grpc", reason="serving tests need tritonclient[grpc] (scripts/setup.sh)")
openai = pytest.importorskip("openai", reason="the OpenAI API tests need the openai client (scripts/setup.sh)")
pytest.importorskip("uvicorn", reason="the OpenAI API needs uvicorn and starlette (scripts/setup.sh)")

from deploy.server import free_ports  # noqa: E402
from runtime.sampling import SamplingParams  # noqa: E402
from tests.test_serving import (  # noqa: E402,F401  (served and the autouse restart: fixtures)
    PROMPTS,
    _a_lost_server_is_restarted,
    offline,
    scrape,
    served,
)

_PORT: list[int] = []


@pytest.fixture(scope="module")
def extra_serve_args() -> list[str]:
    _PORT.append(free_ports(1)[0])
    return ["--openai-port", str(_PORT[0])]


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{_PORT[0]}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(served, client):
    return Path(served.engine).name


def test_models_lists_the_engine(client, model_id, served):
    models = client.models.list()
    assert [m.id for m in models.data] == [model_id]
    assert any("openai   http://127.0.0.1" in line for line in served.output)


def test_chat_stream_equals_runtime_generate_chat(client, model_id, served):
    prompt = PROMPTS[1]
    cli = subprocess.run([sys.executable, "-m", "runtime", "generate", "--model", str(served.engine), "--prompt",
                          prompt, "--chat", "--max-tokens", "24", "--json"], capture_output=True, text=True,
                         cwd=Path(__file__).parent.parent, check=True)
    want = json.loads(cli.stdout)
    chunks = list(client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": prompt}],
                                                 max_tokens=24, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want["text"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want["finish_reason"]
    usage = chunks[-1].usage
    assert usage.completion_tokens == len(want["token_ids"]) and usage.prompt_tokens == want["stats"]["prompt_tokens"]
    spec = usage.model_extra["spec_decode"]
    assert spec["steps"] == want["stats"]["steps"] and spec["accepted_tokens"] == want["stats"]["accepted_tokens"]
    assert spec["acceptance_rate"] == pytest.approx(want["stats"]["acceptance_rate"])
    assert spec["draft_tokens"] == want["stats"]["draft_positions"] and spec["verification"] == "greedy"

    whole = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=24, temperature=0)
    assert whole.choices[0].message.content == want["text"] and whole.choices[0].message.role == "assistant"
    assert whole.usage.total_tokens == usage.total_tokens


def test_completions_stream_whole_echo_and_seeded_sampling(client, model_id, served):
    prompt = PROMPTS[0]
    ref = offline(served, prompt, max_tokens=20)
    out = client.completions.create(model=model_id, prompt=prompt, max_tokens=20, temperature=0)
    assert out.choices[0].text == ref.text and out.choices[0].finish_reason == ref.finish_reason
    assert out.usage.completion_tokens == len(ref.token_ids)
    chunks = list(client.completions.create(model=model_id, prompt=prompt, max_tokens=20, temperature=0, stream=True))
    assert len(chunks) > 2 and "".join(c.choices[0].text for c in chunks) == ref.text
    echo = client.completions.create(model=model_id, prompt=prompt, max_tokens=20, temperature=0, echo=True)
    assert echo.choices[0].text == prompt + ref.text
    # Seeded sampling: sampling_parameters is JSON, so the server samples with exactly 0.7 (no FP32 rounding).
    out = client.completions.create(model=model_id, prompt=prompt, max_tokens=20, temperature=0.7, seed=3)
    assert out.choices[0].text == offline(served, prompt, max_tokens=20, temperature=0.7, seed=3).text


def test_log_probabilities(client, model_id, served):
    prompt = PROMPTS[2]
    ref = served.decoder.generate(prompt, SamplingParams(max_tokens=8, logprobs=3))
    want = [lp for d in served.decoder.stream(prompt, SamplingParams(max_tokens=8, logprobs=3))
            for lp in (d.logprobs or ())]
    out = client.completions.create(model=model_id, prompt=prompt, max_tokens=8, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(want, abs=1e-4) and len(lp.tokens) == len(ref.token_ids)
    assert all(len(t) <= 3 and max(t.values()) >= x - 1e-5 for t, x in zip(lp.top_logprobs, lp.token_logprobs))
    assert "".join(lp.tokens) == ref.text or len(lp.tokens) == len(ref.token_ids)
    chat = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": prompt}],
                                          max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.logprob - 1e-5 for c in content)


def test_errors_come_back_in_openai_shape(client, model_id):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="hi", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match=r"top_p: expected a number in \(0, 1\]"):
        client.completions.create(model=model_id, prompt="hi", max_tokens=4, top_p=1.5)  # SamplingParams refuses it
    with pytest.raises(openai.BadRequestError, match="max_tokens: 100000 is above this server's limit"):
        client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=100000, stream=True)
    with pytest.raises(openai.BadRequestError, match="n: 2"):
        client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}], n=2)


def test_sixteen_concurrent_streams(client, model_id, served):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(16)]
    refs = {p: offline(served, p, max_tokens=24).text for p in set(prompts)}
    results: list = [None] * 16

    def run(i: int) -> None:
        try:
            stream = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": prompts[i]}],
                                                    max_tokens=24, temperature=0, stream=True) if i % 2 else \
                client.completions.create(model=model_id, prompt=prompts[i], max_tokens=24, temperature=0,
                                          stream=True)
            results[i] = "".join((c.choices[0].delta.content or "") if i % 2 else c.choices[0].text for c in stream)
        except Exception as exc:  # noqa: BLE001  (recorded: the test asserts there are none)
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    errors = [r for r in results if isinstance(r, Exception) or r is None]
    assert not errors, errors
    chat_refs = {p: served.decoder.generate([{"role": "user", "content": p}], SamplingParams(max_tokens=24)).text
                 for p in set(prompts)}
    assert all(results[i] == (chat_refs if i % 2 else refs)[prompts[i]] for i in range(16))


def test_a_dropped_stream_cancels_its_generation(client, model_id, served):
    def cancelled() -> float:
        return scrape(served).get("spectree_requests_total", model="spec_decode", outcome="cancelled")

    before = cancelled()
    stream = client.completions.create(model=model_id, prompt=PROMPTS[0], max_tokens=1400, temperature=0.8,
                                       stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    deadline = time.monotonic() + 30
    while cancelled() < before + 1:
        assert time.monotonic() < deadline, "the dropped stream's generation was not cancelled"
        time.sleep(0.2)


@pytest.mark.slow
def test_genai_perf_against_both_endpoints(served, model_id, tmp_path):
    """`perf serve --tool genai-perf`: NVIDIA's genai-perf on the Triton endpoint (the ensemble, tensorrtllm_backend's
    tensors over gRPC) and on this OpenAI API, with the server's speculation statistics beside."""
    pytest.importorskip("genai_perf", reason="genai-perf is installed by scripts/setup.sh")
    from perf.__main__ import main

    out = tmp_path / "gp"
    code = main(["serve", "--tool", "genai-perf", "--url", served.grpc, "--model", "ensemble",
                 "--tokenizer", str(served.engine), "--openai-url", f"127.0.0.1:{_PORT[0]}", "--openai-model",
                 model_id, "--metrics-url", served.metrics, "--concurrency", "1,2", "--requests", "2",
                 "--max-tokens", "8", "--prompts-per-set", "2", "--out", str(out)])
    assert code == 0
    report = json.loads((out / "genai_perf.json").read_text())
    assert set(report["endpoints"]) == {"triton", "openai"}
    for levels in report["endpoints"].values():
        assert [lv["concurrency"] for lv in levels] == [1, 2]
        for lv in levels:
            # min_tokens = max_tokens: exactly 8 tokens per request, warm-up requests (one per concurrent slot)
            # included (genai-perf's OSL re-tokenizes the text, which for this random-weight model's output is not
            # the same count)
            assert lv["spec_decode"]["generated_tokens"] == 8 * (lv["request_count"] + lv["concurrency"])
            assert lv["output_sequence_length"]["avg"] > 0
            assert 0 < lv["time_to_first_token"]["p50"] <= lv["request_latency"]["p50"]
            assert lv["inter_token_latency"]["avg"] > 0 and lv["input_sequence_length"]["avg"] > 0
            spec = lv["spec_decode"]
            assert spec["steps"] > 0 and spec["draft_tokens"] >= spec["steps"]
            assert 0 <= spec["acceptance_rate"] <= 1 and spec["mean_accepted_length"] >= 1
            assert (out / lv["artifacts"] / "profile_export_genai_perf.csv").is_file()
    assert "## triton" in (out / "genai_perf.md").read_text()
