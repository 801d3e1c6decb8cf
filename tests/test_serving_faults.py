"""Serving under load and faults, against a real tritonserver (`deploy serve`, as in tests/test_serving.py):
the bounded queue (capacity + queue all served, more refused with UNAVAILABLE), request limits that
fail fast, client disconnects on the default `ensemble` cancelling their generations, and a killed generation
process taking the server out of readiness. The soak test (slow) streams from 16 clients for ~20 s.

The module's server is small on purpose: 2 generation slots, a queue of 2, a 1 MiB KV budget on an engine with an
8192-token context (the tiny model's KV cache takes 512 bytes a token, so one request may hold about 2000 tokens),
and tight prompt / stop-string limits. Its last test kills it.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.test_serving import (  # the server helpers (this module is skipped with test_serving's)
    MAX_CONTEXT,
    PROMPTS,
    _build_engine,
    check_equal,
    is_ready,
    offline,
    post,
    scrape,
    serve_repo,
    settled_scrape,
    stream,
)
from deploy.client import ClientError, build_inputs, generate_stream
from deploy.server import child_pids, pid_alive, port_is_free, python_stubs

SLOTS, QUEUE = 2, 2
CONTEXT = 8192
KV_MB = 1
LIMITS = {"max_concurrent_requests": SLOTS, "max_queue_size": QUEUE, "kv_memory_mb": KV_MB,
          "max_prompt_bytes": 4096, "max_stop_words": 4, "max_stop_word_bytes": 32}
IGNORE_EOS = {"sampling_parameters": {"ignore_eos": True, "temperature": 0}}  # greedy (vLLM's default is 1.0)
FAST_S = 1.0  # how long a refused request may take


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    with serve_repo(root, _build_engine(root, CONTEXT), **LIMITS) as s:
        yield s


def wait_for(cond, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def house(served) -> tuple[float, float]:
    m = scrape(served)
    return m.get("spectree_active_requests", model="spec_decode"), m.get("spectree_queued_requests", model="spec_decode")


def test_capacity_plus_queue_are_served_and_more_are_overloaded(faulty):
    """SLOTS + QUEUE concurrent streams all complete (equal to offline); one more, while they hold the house,
    is refused at once with UNAVAILABLE ("overloaded: ..."), not with the INVALID_ARG of a bad request. (The code
    reaches a gRPC client in the message, "[UNAVAILABLE] ...", which deploy's client asks for: see deploy/client.py
    for why not as the stream's gRPC status on tritonserver 2.51.)

    Over Triton's own HTTP generate endpoint the refusal is HTTP 400 with the "overloaded: ..." message:
    tritonserver 2.51 reads a model error's code after freeing it there (http_server.cc, InferResponseComplete:
    AddErrorJson deletes the error, then HttpCodeFromError reads it), so every model error of a decoupled model
    comes back as 400 (measured); the OpenAI frontend (deploy/openai_api.py) answers 503."""
    # Long enough that the house stays full while it is probed, also on a busy machine (300 was not, once); the
    # two active requests' KV reservations (prompt + 800 + a 17-node tree each) still fit the 1 MiB budget together.
    n = 800
    results: dict[int, object] = {}
    before = settled_scrape(faulty)

    def client(i: int) -> None:
        try:
            results[i] = stream(faulty, "ensemble", PROMPTS[i], n, **IGNORE_EOS)
        except ClientError as exc:
            results[i] = exc

    threads = [threading.Thread(target=client, args=(i,)) for i in range(SLOTS + QUEUE)]
    for t in threads:
        t.start()
    wait_for(lambda: house(faulty) == (SLOTS, QUEUE), "the slots and the queue never filled")
    full = scrape(faulty)
    refusals = []
    for model in ("ensemble", "spec_decode"):
        t0 = time.monotonic()
        with pytest.raises(ClientError) as e:
            stream(faulty, model, "hi", 4)
        refusals.append((model, time.monotonic() - t0, e.value))
    code, body = post(f"{faulty.http}/v2/models/ensemble/generate", {"text_input": "hi", "max_tokens": 4})
    still_full = house(faulty) == (SLOTS, QUEUE)
    for t in threads:
        t.join(timeout=120)
    assert still_full, "a stream ended before the refusals were checked; lengthen the streams"
    for model, seconds, exc in refusals:
        assert exc.code == "UNAVAILABLE" and exc.unavailable, (model, exc.code, str(exc))
        assert str(exc).startswith("overloaded: ") and seconds < FAST_S, (model, seconds, str(exc))
    assert code == 400 and json.loads(body)["error"].startswith("overloaded: "), (code, body)
    for i in range(SLOTS + QUEUE):
        assert not isinstance(results[i], ClientError), results[i]
        check_equal(results[i], offline(faulty, PROMPTS[i], max_tokens=n, ignore_eos=True))
    # Load shedding is visible: every refusal counted as overloaded by the model that refused it (the ensemble's
    # own max_in_flight refusals included: two here, gRPC and HTTP), and no free slot while the house was full.
    after = settled_scrape(faulty)

    def refused(model: str) -> float:
        return (after.get("spectree_requests_total", model=model, outcome="overloaded")
                - before.get("spectree_requests_total", model=model, outcome="overloaded"))

    assert refused("ensemble") == 2 and refused("spec_decode") == 1
    for model in ("ensemble", "spec_decode"):
        assert full.get("spectree_free_request_slots", model=model) == 0
        assert after.get("spectree_free_request_slots", model=model) == SLOTS + QUEUE


def test_clients_at_full_capacity_back_to_back_are_never_refused(faulty):
    """SLOTS + QUEUE clients, each sending its next request the moment the last one ended: the slot a request held
    is free before its final response goes out, so none is ever refused."""
    errors: list[str] = []
    done = []

    def client(i: int) -> None:
        for k in range(6):
            try:
                events = stream(faulty, "ensemble", PROMPTS[(i + k) % len(PROMPTS)], 8)
            except ClientError as exc:
                errors.append(f"client {i} request {k}: {exc}")
                return
            done.append(events[-1].final)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(SLOTS + QUEUE)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert len(done) == 6 * (SLOTS + QUEUE) and all(done)


def _many_stops(n: int, size: int = 3) -> list:
    return [*build_inputs("hi", 8)[:3], _stop_tensor([f"s{i:0{size}d}" for i in range(n)])]


def _stop_tensor(words: list[str]):
    import tritonclient.grpc as grpcclient

    arr = np.array([w.encode() for w in words], dtype=np.object_)
    t = grpcclient.InferInput("stop_words", [len(words)], "BYTES")
    t.set_data_from_numpy(arr)
    return t


LIMIT_CASES = [
    # (inputs factory, substrings the error must contain)
    (lambda: build_inputs("x" * (4 << 20), 8), ["text_input: 4194304 bytes", "at most 4096 bytes (max_prompt_bytes)"]),
    (lambda: build_inputs([{"role": "user", "content": "y" * (1 << 20)}], 8),
     ["messages: ", "bytes; this server takes prompts of at most 4096 bytes"]),
    (lambda: _many_stops(600), ["stop_words: 600 stop strings; this server takes at most 4 (max_stop_words)"]),
    (lambda: [*build_inputs("hi", 8)[:3], _stop_tensor(["z" * 600_000])],
     ["stop_words[0]: 600000 bytes", "at most 32 bytes (max_stop_word_bytes)"]),
    (lambda: build_inputs("hi", 8, sampling_parameters={"stop": [str(i) for i in range(100)]}),
     ["sampling_parameters.stop: 100 stop strings"]),
    (lambda: build_inputs("hi", CONTEXT + 1), [f"max_tokens: {CONTEXT + 1} is above this server's limit of {CONTEXT}"]),
    # Within the context, but more KV cache than the instance's budget: refused before any is allocated.
    (lambda: build_inputs("hi", 6000), ["max_tokens: 6000 with a ", "MiB of KV cache; this instance's KV budget is "
                                        "1.0 MiB (kv_memory_mb), so this prompt allows max_tokens <= "]),
]


@pytest.mark.parametrize("case", range(len(LIMIT_CASES)))
@pytest.mark.parametrize("model", ["ensemble", "spec_decode"])
def test_oversized_requests_fail_fast_and_the_server_keeps_serving(faulty, model, case):
    make, expected = LIMIT_CASES[case]
    inputs = make()
    t0 = time.monotonic()
    with pytest.raises(ClientError) as e:
        list(stream_inputs(faulty, model, inputs))
    seconds = time.monotonic() - t0
    for part in expected:
        assert part in str(e.value), str(e.value)
    assert e.value.code == "INVALID_ARG"
    assert seconds < FAST_S, f"{seconds:.2f} s"
    assert is_ready(faulty)
    assert house(faulty) == (0, 0)
    check_equal(stream(faulty, model, PROMPTS[0], 6), offline(faulty, PROMPTS[0], max_tokens=6))


def stream_inputs(served, model: str, inputs: list):
    """stream_infer with [1]-shaped inputs, given a batch dimension for a model that batches."""
    from deploy.client import model_batches, stream_infer

    if model_batches(served.grpc, model):
        for t in inputs:
            t.set_shape([1, *t.shape()])
    return stream_infer(served.grpc, model, inputs, timeout_s=60)


def _stub(served, instance: str):
    stubs = {s.instance: s for s in python_stubs(child_pids(served.server_pid)).values()}
    return stubs[instance]


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def test_disconnects_on_the_ensemble_cancel_their_generations(faulty):
    """20 clients of the default `ensemble` leave after their first response: each generation is cancelled
    within a couple of steps (counted as cancelled, none runs to its 1800 tokens), the slots, queue and KV
    reservations are back to zero and the generation process's memory is back to its baseline."""
    stub = _stub(faulty, "spec_decode_0_0")
    stream(faulty, "ensemble", PROMPTS[0], 32)  # warm up
    baseline = _rss_mib(stub.pid)
    before = settled_scrape(faulty)

    def cancelled() -> float:
        return scrape(faulty).get("spectree_requests_total", model="spec_decode", outcome="cancelled")

    start = cancelled()
    for i in range(20):
        s = generate_stream(faulty.grpc, "ensemble", PROMPTS[i % len(PROMPTS)], 1800, timeout_s=60, **IGNORE_EOS)
        first = next(s)
        assert not first.final
        s.close()  # the client disconnects (its gRPC stream is cancelled)
        wait_for(lambda: cancelled() == start + i + 1, f"disconnect {i} was not cancelled", timeout_s=5)
    after = settled_scrape(faulty)

    def delta(outcome: str) -> float:
        return (after.get("spectree_requests_total", model="spec_decode", outcome=outcome)
                - before.get("spectree_requests_total", model="spec_decode", outcome=outcome))

    assert delta("cancelled") == 20 and delta("completed") == 0
    assert house(faulty) == (0, 0) and after.get("spectree_kv_reserved_bytes", model="spec_decode") == 0
    assert _rss_mib(stub.pid) < baseline + 32, (baseline, _rss_mib(stub.pid))
    board = Path(tempfile.gettempdir()) / f"spectree-cancel-{os.getuid()}-{faulty.server_pid}"
    assert not board.exists() or not any(board.iterdir()), "cancellation marks left behind"


def test_a_killed_generation_process_takes_the_server_down_fast(faulty):
    """Last (it ends the server). kill -9 of spec_decode's python stub: within seconds the server is no longer
    ready, the stream in flight ends with an error instead of hanging, `deploy serve` says what happened and exits
    with status 3, and nothing is left: processes, ports, shared memory."""
    stubs = python_stubs(child_pids(faulty.server_pid))
    regions = [s.region for s in stubs.values()]
    assert {s.instance for s in stubs.values()} == {"ensemble_0_0", "preprocessing_0_0", "spec_decode_0_0"}
    outcome: dict[str, object] = {}

    def client() -> None:
        t0 = time.monotonic()
        try:
            stream(faulty, "ensemble", PROMPTS[1], 1800, **IGNORE_EOS)
            outcome["result"] = "completed"
        except ClientError as exc:
            outcome["result"] = exc
        outcome["seconds"] = time.monotonic() - t0

    t = threading.Thread(target=client)
    t.start()
    wait_for(lambda: house(faulty)[0] == 1, "the stream never started")
    killed_at = time.monotonic()
    os.kill(_stub(faulty, "spec_decode_0_0").pid, signal.SIGKILL)
    wait_for(lambda: not is_ready(faulty), "the server stayed ready", timeout_s=5)
    t.join(timeout=20)
    assert not t.is_alive(), "the in-flight stream hung"
    assert isinstance(outcome["result"], ClientError), outcome
    assert faulty.cli.wait(timeout=15) == 3
    assert time.monotonic() - killed_at < 15
    out = "".join(faulty.output)
    assert "spec_decode_0_0" in out and "died" in out and "exit status 3" in out, out
    for pid in [faulty.server_pid, *stubs]:
        assert not pid_alive(pid), f"process {pid} outlived the server"
    for port in faulty.ports:
        assert port_is_free(port), f"port {port} still bound"
    for region in regions:
        assert not Path("/dev/shm", region).exists(), f"shared memory {region} left behind"


# ---- soak (slow) ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def soak_served(tmp_path_factory):
    root = tmp_path_factory.mktemp("soak")
    with serve_repo(root, _build_engine(root, MAX_CONTEXT)) as s:  # the default slots and queue
        yield s


@pytest.mark.slow
def test_soak_16_streaming_clients(soak_served):
    """16 concurrent streaming gRPC clients for ~20 s on loopback: no errors, every output equal to the offline
    runtime's (greedy = plain decoding; same seed => same output), the server's memory flat. The recorded 60 s
    runs (16 and 64 clients): python -m perf.soak (perf/results/)."""
    from perf.soak import SoakConfig, reference_cases, run_soak, server_pids

    cases = reference_cases(soak_served.decoder, PROMPTS, 24)
    result = run_soak(SoakConfig(url=soak_served.grpc, clients=16, seconds=20, max_tokens=24), cases,
                      server_pids(soak_served.server_pid))
    summary = result.summary()
    assert result.errors == [] and result.mismatches == [] and result.overloaded == 0, summary
    assert result.completed >= 16, summary
    assert summary["rss_mib"]["growth"] is not None and summary["rss_mib"]["growth"] < 64, summary
