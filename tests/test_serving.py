"""A real tritonserver (the nvidia-pytriton wheel's, started by `python -m deploy serve`) serving a rendered
repository for a real engine directory: streamed generations equal the offline runtime, bad requests get clear
errors while the server stays ready, concurrent streams, cancellation, metrics, and a clean shutdown.

One server for the whole module (started once, always killed); ports are chosen free at run time. `serve_repo`
starts one for any engine and render options (tests/test_serving_faults.py uses it for its own servers).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc", reason="serving tests need tritonclient[grpc] (scripts/setup.sh)")

import runtime
from deploy.client import ClientError, build_inputs, generate_stream, model_batches, stream_infer
from deploy.server import (
    ServerError,
    child_pids,
    find_installation,
    free_ports,
    pid_alive,
    port_is_free,
    shm_regions,
)
from model_repo.render import RepoOptions, render
from runtime.sampling import SamplingParams
from tests.heads import write_medusa_head
from tests.tiny import make_checkpoint, vocab_size

try:
    find_installation()
except ServerError as exc:  # no tritonserver on PATH and no nvidia-pytriton wheel
    pytest.skip(f"no tritonserver available: {exc}", allow_module_level=True)

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time there was a small model",
    "def add(a, b):",
    "Café, naïve, résumé 日本語 🙂",
]
# ChatML, as SmolLM2-Instruct's; the engine carries it as chat_template.jinja (copied by the builder).
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPTS[1]}]
MAX_CONTEXT = 2048
MAX_TOKENS_LIMIT = 1500
SLOTS = 8
ADMIN_TOKEN = "admin-token-for-the-tests-0123456789"  # given to every test server in the environment


@dataclass
class Served:
    engine: Path
    repo: Path
    decoder: object  # the offline runtime on the same engine
    cli: subprocess.Popen
    server_pid: int
    stub_pids: list[int]
    http: str
    grpc: str
    metrics: str
    ports: list[int]
    output: list[str]
    openai: str | None = None  # the OpenAI API's base URL (http://HOST:PORT/v1) when served with --openai-port
    restart: Callable[[], Served] | None = None  # a new server like this one (module fixtures set it)


def _build_engine(root: Path, max_context: int = MAX_CONTEXT) -> Path:
    from builder.build import build_engine
    from builder.config import parse_config

    ckpt = make_checkpoint(root / "llama2", "llama2", max_position_embeddings=max_context)
    (ckpt / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    heads = write_medusa_head(root / "medusa", 64, vocab_size(), num_heads=3)
    cfg = parse_config({"model": {"checkpoint": str(ckpt)},
                        "draft": {"method": "medusa", "checkpoint": str(heads),
                                  "tree": {"choices": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]}},
                        "build": {"output": str(root / "engine"), "onnx": False, "tensorrt": False,
                                  "max_draft_len": 16}}, root, "serving.yaml")
    return build_engine(cfg).output


def _read_lines(stream, sink: queue.Queue, keep: list[str]) -> None:
    for line in iter(stream.readline, ""):
        keep.append(line)
        sink.put(line)


@contextlib.contextmanager
def serve_repo(root: Path, engine: Path, extra_serve_args: Sequence[str] = (), **render_options):
    """`python -m deploy serve` (plus extra_serve_args) on a repository rendered for `engine` (torch_threads 1
    unless given); yields a Served once it printed "ready", and leaves nothing running."""
    repo = root / "repo"
    render(RepoOptions(engine=str(engine), output=str(repo), **{"torch_threads": 1, **render_options}))
    http, grpc, metrics = free_ports(3)
    env = dict(os.environ, OMP_NUM_THREADS="1", SPECTREE_ADMIN_TOKEN=ADMIN_TOKEN)
    cli = subprocess.Popen(
        [sys.executable, "-m", "deploy", "serve", "--repo", str(repo), "--http-port", str(http), "--grpc-port",
         str(grpc), "--metrics-port", str(metrics), "--exit-timeout-s", "10", "--log-file", str(root / "server.log"),
         *extra_serve_args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=Path(__file__).parent.parent,
    )
    lines: queue.Queue = queue.Queue()
    output: list[str] = []
    threading.Thread(target=_read_lines, args=(cli.stdout, lines, output), daemon=True).start()
    server_pid = internal = None
    try:
        deadline = time.monotonic() + 240
        while server_pid is None:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"the server was not ready in time; output:\n{''.join(output)}") from None
            m = re.match(r"ready \(tritonserver pid (\d+)", line)
            if m:
                server_pid = int(m.group(1))
                internal = re.search(r"HTTP front over tritonserver's http://127\.0\.0\.1:(\d+)", line)
            elif cli.poll() is not None:
                time.sleep(0.2)
                raise AssertionError(f"deploy serve exited with {cli.returncode}:\n{''.join(output)}\n"
                                     f"{(root / 'server.log').read_text(errors='replace')[-3000:]}")
        stubs = child_pids(server_pid)
        args = list(extra_serve_args)
        openai = f"http://127.0.0.1:{args[args.index('--openai-port') + 1]}/v1" if "--openai-port" in args else None
        yield Served(engine=engine, repo=repo, decoder=runtime.load(engine), cli=cli, server_pid=server_pid,
                     stub_pids=stubs, http=f"http://127.0.0.1:{http}", grpc=f"127.0.0.1:{grpc}",
                     metrics=f"http://127.0.0.1:{metrics}/metrics", output=output, openai=openai,
                     ports=[http, grpc, metrics, *([int(internal.group(1))] if internal else [])])
    finally:
        # Whatever the tests did, nothing is left running: the CLI gets SIGTERM, then everything gets SIGKILL.
        if cli.poll() is None:
            cli.send_signal(signal.SIGTERM)
            try:
                cli.wait(timeout=60)
            except subprocess.TimeoutExpired:
                cli.kill()
        if server_pid is not None:
            try:
                os.killpg(server_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture(scope="module")
def served(tmp_path_factory, extra_serve_args):
    root = tmp_path_factory.mktemp("serving")
    engine = _build_engine(root)
    with contextlib.ExitStack() as running:
        def start(n: int) -> Served:
            (root / f"run{n}").mkdir()
            s = running.enter_context(serve_repo(root / f"run{n}", engine, extra_serve_args,
                                                 max_concurrent_requests=SLOTS, max_tokens_limit=MAX_TOKENS_LIMIT))
            s.restart = lambda: start(n + 1)
            return s

        yield start(0)


@pytest.fixture(autouse=True)
def _a_lost_server_is_restarted(request):
    """tritonserver 2.51 has crashes of its own (gRPC races fixed upstream in later releases); `deploy serve` then
    shows the crash report and exits (test_serving_faults checks that). A server lost between two tests is reported
    as a warning with what `deploy serve` said, and a new one serves the module's remaining tests; a test whose own
    requests met the crash still fails."""
    if "served" not in request.fixturenames:
        yield
        return
    served = request.getfixturevalue("served")
    if served.cli.poll() is not None and served.restart is not None:
        warnings.warn(f"the test server was lost before {request.node.name}; restarted. It said:\n"
                      + "".join(served.output[-20:]), stacklevel=1)
        vars(served).update(vars(served.restart()))
    yield


# ---- helpers --------------------------------------------------------------------------------------------


def offline(served: Served, prompt: str, **sampling):
    return served.decoder.generate(prompt, SamplingParams(**sampling))


def f32(x: float) -> float:
    """What an FP32 input carries: the server samples with exactly this value."""
    return float(np.float32(x))


def stream(served: Served, model: str, prompt: str, max_tokens: int, **options) -> list:
    return list(generate_stream(served.grpc, model, prompt, max_tokens, timeout_s=120, **options))


def check_equal(events: list, ref) -> None:
    assert "".join(e.text for e in events) == ref.text
    assert [t for e in events for t in e.token_ids] == list(ref.token_ids)
    last = events[-1]
    assert last.final and all(not e.final for e in events[:-1])
    assert last.finish_reason == ref.finish_reason
    assert last.verification == ref.stats.verification
    assert last.accepted_per_step == ref.stats.accepted_per_step
    assert last.tau == pytest.approx(ref.stats.tau)


def assert_nothing_left(pids: Sequence[int], ports: Sequence[int], regions: Sequence[str]) -> None:
    """After a server stopped: none of its processes alive, none of its ports bound, none of its stubs' shared
    memory regions left."""
    for pid in pids:
        assert not pid_alive(pid), f"process {pid} outlived the server"
    for port in ports:
        assert port_is_free(port), f"port {port} still bound"
    for region in regions:
        assert not Path("/dev/shm", region).exists(), f"shared memory {region} left behind"


def is_ready(served: Served) -> bool:
    try:
        with urllib.request.urlopen(f"{served.http}/v2/health/ready", timeout=5) as r:
            return r.status == 200
    except OSError:  # URLError, and a connection reset by a server going down mid-answer (deploy.server alike)
        return False


def post(url: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class Metrics:
    """One scrape of the metrics port (Prometheus text format), spectree_* series only."""

    def __init__(self, text: str) -> None:
        self.series: list[tuple[str, dict[str, str], float]] = []
        for line in text.splitlines():
            m = re.match(r"^(spectree_\w+)(?:\{(.*)\})? (\S+)$", line)
            if m:
                labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
                self.series.append((m.group(1), labels, float(m.group(3))))

    def get(self, name: str, **labels: str) -> float:
        """Sum of the series called `name` whose labels include `labels` (0 when there is none)."""
        return sum(v for n, lab, v in self.series if n == name and labels.items() <= lab.items())


def scrape(served: Served) -> Metrics:
    with urllib.request.urlopen(served.metrics, timeout=10) as r:
        return Metrics(r.read().decode())


def settled_scrape(served: Served) -> Metrics:
    """A scrape once every finished request is counted: spec_decode records a request's outcome just after
    sending its final response, so a client can see the end of a request before the metrics do."""
    deadline = time.monotonic() + 30
    last = scrape(served)
    while True:
        time.sleep(0.2)
        now = scrape(served)
        if (now.get("spectree_requests_total") == last.get("spectree_requests_total")
                and now.get("spectree_active_requests", model="spec_decode") == 0):
            return now
        assert time.monotonic() < deadline, "the request metrics never settled"
        last = now


# ---- tests ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["ensemble", "spec_decode"])
def test_stream_equals_offline_greedy_and_sampled(served, model):
    prompt = PROMPTS[0]
    ref = offline(served, prompt, max_tokens=40)
    events = stream(served, model, prompt, 40)
    assert len(events) > 2  # streamed: one response per decode step, not one at the end
    check_equal(events, ref)
    assert ref.stats.verification == "greedy"

    sampled = {"temperature": f32(0.9), "top_k": 50, "top_p": f32(0.95), "seed": 1234}
    ref = offline(served, prompt, max_tokens=40, **sampled)
    events = stream(served, model, prompt, 40, temperature=0.9, top_k=50, top_p=0.95, seed=1234)
    check_equal(events, ref)
    assert ref.stats.verification.startswith("rejection_sampling/")
    # The same seed gives the same stream again; another seed a different one.
    assert "".join(e.text for e in stream(served, model, prompt, 40, temperature=0.9, top_k=50, top_p=0.95,
                                          seed=1234)) == ref.text
    other = offline(served, prompt, max_tokens=40, **{**sampled, "seed": 99})
    assert other.token_ids != ref.token_ids


def test_stop_words_and_whole_response(served):
    prompt = PROMPTS[1]
    full = offline(served, prompt, max_tokens=30, ignore_eos=True)
    stop = full.text[6:9]
    ref = offline(served, prompt, max_tokens=30, stop=(stop,))
    events = stream(served, "ensemble", prompt, 30, stop=(stop,))
    check_equal(events, ref)
    assert ref.finish_reason == "stop"
    # Not streamed: one response with the prompt in front (tensorrtllm_backend's exclude_input_in_output default).
    events = stream(served, "ensemble", prompt, 12, stream=False)
    ref = offline(served, prompt, max_tokens=12)
    assert len(events) == 1 and events[0].text == prompt + ref.text
    events = stream(served, "spec_decode", prompt, 12, stream=False, exclude_input_in_output=True)
    assert len(events) == 1 and events[0].text == ref.text


def test_http_generate_and_generate_stream(served):
    prompt = PROMPTS[3]
    ref = offline(served, prompt, max_tokens=16)
    code, body = post(f"{served.http}/v2/models/ensemble/generate", {"text_input": prompt, "max_tokens": 16})
    assert code == 200, body
    out = json.loads(body)
    assert out["text_output"] == prompt + ref.text and out["verification"] == "greedy"

    code, body = post(f"{served.http}/v2/models/spec_decode/generate_stream",
                      {"text_input": prompt, "max_tokens": 16, "stream": True, "temperature": 0.5, "random_seed": 5})
    assert code == 200, body
    events = [json.loads(line[len("data: "):]) for line in body.splitlines() if line.startswith("data: ")]
    ref = offline(served, prompt, max_tokens=16, temperature=0.5, seed=5)
    assert len(events) > 1 and "".join(e["text_output"] for e in events) == ref.text
    assert events[-1]["finish_reason"] == ref.finish_reason


@pytest.mark.parametrize("model", ["ensemble", "spec_decode"])
def test_messages_stream_equals_offline_chat(served, model):
    ref = served.decoder.generate(MESSAGES, SamplingParams(max_tokens=24))
    assert ref.stats.prompt_tokens == len(served.decoder.tokenizer.apply_chat_template(MESSAGES))
    check_equal(stream(served, model, MESSAGES, 24), ref)
    # Not streamed: a chat prompt is not echoed (there is no prompt text to repeat).
    events = stream(served, model, MESSAGES, 24, stream=False)
    assert len(events) == 1 and events[0].text == ref.text
    # Over HTTP's generate endpoint, messages is a JSON string like any STRING input.
    code, body = post(f"{served.http}/v2/models/{model}/generate", {"messages": json.dumps(MESSAGES), "max_tokens": 24})
    assert code == 200 and json.loads(body)["text_output"] == ref.text, body


def test_client_cli(served):
    prompt = PROMPTS[0]
    ref = offline(served, prompt, max_tokens=20, temperature=f32(0.6), seed=8)
    r = subprocess.run([sys.executable, "-m", "deploy", "client", "--url", served.grpc, "--prompt", prompt,
                        "--max-tokens", "20", "--temperature", "0.6", "--seed", "8", "--stats"],
                       capture_output=True, timeout=120, cwd=Path(__file__).parent.parent, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode() == ref.text + "\n"
    assert f"finish_reason={ref.finish_reason} verification={ref.stats.verification}" in r.stderr.decode()
    r = subprocess.run([sys.executable, "-m", "deploy", "client", "--url", served.grpc, "--prompt", prompt,
                        "--max-tokens", "20", "--top-p", "0"], capture_output=True, timeout=120,
                       cwd=Path(__file__).parent.parent, check=False)
    assert r.returncode == 1 and "top_p: expected a number in (0, 1]" in r.stderr.decode()
    r = subprocess.run([sys.executable, "-m", "deploy", "client", "--url", served.grpc, "--prompt", PROMPTS[1],
                        "--chat", "--system", "Be brief.", "--max-tokens", "20"], capture_output=True, timeout=120,
                       cwd=Path(__file__).parent.parent, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode() == served.decoder.generate(MESSAGES, max_tokens=20).text + "\n"


def grpc_error(served: Served, model: str, inputs: list) -> str:
    if model_batches(served.grpc, model):  # the ensemble takes [batch, ...] tensors (tensorrtllm_backend's shapes)
        for t in inputs:
            t.set_shape([1, *t.shape()])
    with pytest.raises(ClientError) as e:
        list(stream_infer(served.grpc, model, inputs, timeout_s=60))
    return str(e.value)


def _tensor(name, array, wire):
    import tritonclient.grpc as grpcclient

    t = grpcclient.InferInput(name, list(array.shape), wire)
    t.set_data_from_numpy(array)
    return t


BAD_REQUESTS = [
    # (model, inputs factory, substrings the error must contain)
    ("ensemble", lambda: build_inputs("", 8), ["text_input: empty"]),
    ("spec_decode", lambda: build_inputs("", 8), ["text_input: empty"]),
    ("ensemble", lambda: build_inputs("hi", 8)[1:], ["text_input: missing"]),
    ("spec_decode", lambda: build_inputs("hi", 8)[1:], ["text_input: missing"]),
    ("ensemble", lambda: [build_inputs("hi", 8)[0]], ["max_tokens: missing"]),
    ("ensemble", lambda: build_inputs("hi", 0), ["max_tokens: expected an integer >= 1, got 0"]),
    ("spec_decode", lambda: build_inputs("hi", -5), ["max_tokens: expected an integer >= 1, got -5"]),
    ("ensemble", lambda: build_inputs("hi", MAX_TOKENS_LIMIT + 1),
     [f"max_tokens: {MAX_TOKENS_LIMIT + 1} is above this server's limit of {MAX_TOKENS_LIMIT}"]),
    ("ensemble", lambda: [build_inputs("hi", 8)[0], _tensor("max_tokens", np.array([8.0], np.float32), "FP32")],
     ["max_tokens", "FP32", "INT32"]),  # wrong dtype: refused by Triton before the model runs
    ("spec_decode", lambda: [*build_inputs("hi", 8), _tensor("temperature", np.array([1], np.int32), "INT32")],
     ["temperature", "INT32", "FP32"]),
    ("ensemble", lambda: build_inputs(PROMPTS[0] * 200, 8), ["text_input: the prompt is", "context limit is 2048"]),
    ("spec_decode", lambda: build_inputs(PROMPTS[0] * 200, 8), ["text_input: prompt has", "context limit is 2048"]),
    ("ensemble", lambda: build_inputs("hi", 8, temperature=-1.0), ["temperature: expected a finite number >= 0"]),
    ("ensemble", lambda: build_inputs("hi", 8, top_p=0.0), ["top_p: expected a number in (0, 1]"]),
    ("spec_decode", lambda: build_inputs("hi", 8, top_p=1.5), ["top_p: expected a number in (0, 1]"]),
    ("ensemble", lambda: build_inputs("hi", 8, sampling_parameters={"temprature": 1}),
     ["sampling_parameters: unknown key(s) ['temprature']"]),
    ("ensemble", lambda: [*build_inputs("hi", 8), _tensor("beam_width", np.array([2], np.int32), "INT32")],
     ["beam_width"]),
    ("ensemble", lambda: [*build_inputs("hi", 8), *build_inputs(MESSAGES, 8)[:1]],
     ["text_input and messages: both given"]),
    ("spec_decode", lambda: [*build_inputs("hi", 8), *build_inputs(MESSAGES, 8)[:1]],
     ["text_input and messages: both given"]),
    ("ensemble", lambda: build_inputs([{"role": "user", "content": "a"}, {"role": 3, "content": "b"}], 8),
     ["messages[1].role must be a string, got 3"]),
    ("spec_decode", lambda: build_inputs([{"role": "user", "content": 5}], 8),
     ["messages[0].content must be a string, got 5"]),
]


@pytest.mark.parametrize("case", range(len(BAD_REQUESTS)))
def test_bad_requests_get_clear_errors_and_the_server_stays_ready(served, case):
    model, make, expected = BAD_REQUESTS[case]
    message = grpc_error(served, model, make())
    for part in expected:
        assert part in message, message
    assert is_ready(served)


def test_error_codes_over_http(served):
    # INVALID_ARG -> 400 with the message; the server keeps serving.
    code, body = post(f"{served.http}/v2/models/ensemble/generate", {"text_input": "hi", "max_tokens": 8, "top_p": 2})
    assert code == 400 and "top_p: expected a number in (0, 1]" in json.loads(body)["error"]
    code, body = post(f"{served.http}/v2/models/ensemble/generate", {"text_input": "hi", "max_tokens": 4})
    assert code == 200 and json.loads(body)["finish_reason"] in ("stop", "length")


def test_eight_concurrent_streams(served):
    jobs = []
    for i in range(8):
        prompt = PROMPTS[i % len(PROMPTS)]
        sampling = {} if i % 2 == 0 else {"temperature": 0.8, "top_p": 0.9, "seed": 100 + i}
        jobs.append((prompt, 24 + 4 * i, i % 3 == 0, sampling))

    def one(job):
        prompt, n, via_ensemble, sampling = job
        return stream(served, "ensemble" if via_ensemble else "spec_decode", prompt, n, **sampling)

    before = settled_scrape(served)
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, jobs))
    for (prompt, n, _, sampling), events in zip(jobs, results):
        offline_sampling = {"temperature": f32(sampling["temperature"]), "top_p": f32(sampling["top_p"]),
                            "seed": sampling["seed"]} if sampling else {}
        check_equal(events, offline(served, prompt, max_tokens=n, **offline_sampling))
    after = settled_scrape(served)
    done = {"model": "spec_decode", "outcome": "completed"}
    assert after.get("spectree_requests_total", **done) - before.get("spectree_requests_total", **done) == 8
    assert after.get("spectree_active_requests", model="spec_decode") == 0


def test_concurrent_streams_are_verified_in_one_batch(served):
    """spec_decode batches in flight: concurrent greedy streams share target forwards (mean batch above 1 on the
    scheduler's counters) and each equals the offline runtime, which equals plain greedy decoding; two requests
    with the same seed, in flight together with the others, give the same output, the offline one."""
    seeded = {"temperature": 0.8, "top_p": 0.9, "seed": 4242}
    jobs = [(PROMPTS[i % len(PROMPTS)], {}) for i in range(4)] + [(PROMPTS[1], seeded), (PROMPTS[1], seeded)]
    start = threading.Barrier(len(jobs))

    def one(job):
        prompt, sampling = job
        start.wait(30)
        # greedy unless the job gives a temperature (a sampling_parameters request without one is vLLM's 1.0)
        long = {"ignore_eos": True, **({} if sampling else {"temperature": 0})}
        return stream(served, "spec_decode", prompt, 48, **sampling, sampling_parameters=long)

    before = settled_scrape(served)
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(one, jobs))
    after = settled_scrape(served)
    for (prompt, sampling), events in zip(jobs, results):
        offline_sampling = {"temperature": f32(0.8), "top_p": f32(0.9), "seed": 4242} if sampling else {}
        check_equal(events, offline(served, prompt, max_tokens=48, ignore_eos=True, **offline_sampling))
    assert [t for e in results[4] for t in e.token_ids] == [t for e in results[5] for t in e.token_ids]
    inst = {"model": "spec_decode", "instance": "spec_decode_0_0"}
    forwards = after.get("spectree_batch_forwards_total", **inst) - before.get("spectree_batch_forwards_total", **inst)
    segments = after.get("spectree_batch_segments_total", **inst) - before.get("spectree_batch_segments_total", **inst)
    assert forwards > 0 and segments / forwards > 1, (forwards, segments)


def test_a_full_house_queues_and_a_cancelled_stream_frees_its_slot(served):
    long = {"sampling_parameters": {"ignore_eos": True, "temperature": 0}}
    busy = [generate_stream(served.grpc, "spec_decode", PROMPTS[i % 4], MAX_TOKENS_LIMIT, timeout_s=60, **long)
            for i in range(SLOTS)]
    before = settled_scrape(served)
    waiting: list = []
    try:
        for s in busy:
            first = next(s)  # each stream is generating: it holds a slot
            assert not first.final
        assert scrape(served).get("spectree_active_requests", model="spec_decode") == SLOTS
        # One more waits in the queue instead of being refused ...
        waiter = threading.Thread(target=lambda: waiting.append(stream(served, "spec_decode", PROMPTS[0], 6)))
        waiter.start()
        deadline = time.monotonic() + 30
        while scrape(served).get("spectree_queued_requests", model="spec_decode") != 1:
            assert time.monotonic() < deadline, "the extra request was not queued"
            time.sleep(0.1)
        assert not waiting
        busy[0].close()  # ... and runs once a stream is cancelled (its slot freed)
        waiter.join(timeout=60)
        check_equal(waiting[0], offline(served, PROMPTS[0], max_tokens=6))
    finally:
        for s in busy:
            s.close()
    deadline = time.monotonic() + 30
    while scrape(served).get("spectree_active_requests", model="spec_decode") != 0:
        assert time.monotonic() < deadline, "cancelled streams kept running"
        time.sleep(0.2)
    after = settled_scrape(served)

    def delta(outcome: str) -> float:
        return (after.get("spectree_requests_total", model="spec_decode", outcome=outcome)
                - before.get("spectree_requests_total", model="spec_decode", outcome=outcome))

    assert delta("cancelled") == SLOTS  # none ran to its 1500 tokens
    assert delta("completed") == 1 and delta("overloaded") == 0
    assert after.get("spectree_kv_reserved_bytes", model="spec_decode") == 0


def test_tiny_temperature_is_greedy(served):
    """temperature 1e-45 (FP32's smallest) is greedy, not an internal error (logits / 1e-45 overflow)."""
    events = stream(served, "ensemble", PROMPTS[1], 16, temperature=1e-45, seed=3)
    check_equal(events, offline(served, PROMPTS[1], max_tokens=16))
    assert events[-1].verification == "greedy"


def test_special_token_text_in_a_prompt_is_literal(served):
    text = "Say </s> and <s> then <|eot_id|> please"
    tok = served.decoder.tokenizer
    literal = tok.encode(text, parse_special=False)
    assert not set(literal[1:]) & {tok.bos_token_id, *tok.eos_token_ids}
    for model in ("ensemble", "spec_decode"):
        check_equal(stream(served, model, text, 12), offline(served, literal, max_tokens=12))
    # Asked for, the special-token text becomes the special tokens (transformers' encoding).
    parsed = stream(served, "ensemble", text, 12, extra={"parse_special_tokens": np.array([True])})
    check_equal(parsed, offline(served, tok.encode(text), max_tokens=12))


def test_admin_apis_are_restricted(served):
    """Triton's shared-memory, model-repository, trace and logging APIs refuse requests without the admin header
    (a client could otherwise read a /dev/shm region back through a prompt, or change logging over the network)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    for method, path, body in (("POST", "/v2/systemsharedmemory/region/r/register",
                                {"key": "/triton_python_backend_shm_region_x", "offset": 0, "byte_size": 64}),
                               ("GET", "/v2/systemsharedmemory/status", None),
                               ("POST", "/v2/logging", {"log_verbose_level": 1}),
                               ("GET", "/v2/trace/setting", None),
                               ("POST", "/v2/repository/index", {})):
        req = urllib.request.Request(f"{served.http}{path}", method=method,
                                     data=None if body is None else json.dumps(body).encode())
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 403, (path, e.value.code)
    client = grpcclient.InferenceServerClient(served.grpc)
    for call in (lambda: client.register_system_shared_memory("r", "/triton_python_backend_shm_region_x", 64),
                 lambda: client.update_log_settings({"log_verbose_level": 1}),
                 lambda: client.get_system_shared_memory_status()):
        with pytest.raises(InferenceServerException, match="This protocol is restricted"):
            call()
    assert client.is_server_ready() and client.get_model_config("ensemble")  # what clients need stays open
    # With the token they answer (it reached tritonserver), though no command line shows it (ps: every local user).
    admin = {"spectree-admin": ADMIN_TOKEN}
    assert client.get_system_shared_memory_status(headers={"triton-grpc-protocol-spectree-admin": ADMIN_TOKEN})
    client.close()
    with urllib.request.urlopen(urllib.request.Request(f"{served.http}/v2/systemsharedmemory/status", headers=admin),
                                timeout=10) as r:
        assert r.status == 200
    for pid in (served.server_pid, served.cli.pid):
        assert ADMIN_TOKEN.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    assert not any("warning" in line for line in served.output), served.output


def test_speculation_metrics(served):
    prompt = PROMPTS[2]
    before = settled_scrape(served)
    events = stream(served, "spec_decode", prompt, 30, temperature=0.7, seed=3)
    ref = offline(served, prompt, max_tokens=30, temperature=f32(0.7), seed=3)
    check_equal(events, ref)
    after = settled_scrape(served)
    lab = {"model": "spec_decode", "verification": "rejection_sampling"}

    def delta(name: str, **labels: str) -> float:
        return after.get(name, **labels) - before.get(name, **labels)

    st = ref.stats
    assert delta("spectree_generated_tokens_total", model="spec_decode") == st.generated_tokens
    assert delta("spectree_verify_steps_total", **lab) == st.steps > 0
    assert delta("spectree_verify_steps_total", model="spec_decode", verification="greedy") == 0
    assert delta("spectree_tree_nodes_total", **lab) == st.drafted_tokens
    assert delta("spectree_accepted_tokens_total", **lab) == st.accepted_tokens
    assert delta("spectree_accepted_tokens_per_step_count", **lab) == st.steps
    assert delta("spectree_accepted_tokens_per_step_sum", **lab) == sum(st.accepted_per_step)
    assert delta("spectree_accepted_tokens_per_step_bucket", le="+Inf", **lab) == st.steps
    assert delta("spectree_tau_count", **lab) == 1
    assert delta("spectree_tau_sum", **lab) == pytest.approx(st.tau)
    assert after.get("spectree_generation_slots", model="spec_decode", instance="spec_decode_0_0") == SLOTS


def test_shutdown_is_clean(served):
    """Last: SIGTERM to `deploy serve` stops tritonserver and its stubs, frees the ports, exits 0."""
    assert served.stub_pids, "the server's python stubs were not found"
    regions = shm_regions(served.stub_pids)
    # ensemble, preprocessing and spec_decode, one instance each
    assert len(regions) == len(served.stub_pids) == 3
    t0 = time.monotonic()
    served.cli.send_signal(signal.SIGTERM)
    assert served.cli.wait(timeout=90) == 0, "".join(served.output)
    # Prompt, even after the wrong-dtype requests the ensemble answered earlier (BAD_REQUESTS), which left a
    # Triton ensemble unable to unload (32 s and exit 1); nothing was in flight, so no exit timeout to wait out.
    assert time.monotonic() - t0 < 15
    out = "".join(served.output)
    assert "shutting down (SIGTERM)" in out
    assert re.search(r"stopped \((tritonserver exit status 0|every request finished; tritonserver 2\.51)", out), out
    assert_nothing_left([served.server_pid, *served.stub_pids], served.ports, regions)
