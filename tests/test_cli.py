"""`python -m runtime generate`: real subprocesses, compared with the Python API."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import runtime
from tests.tiny import make_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("cli") / "llama2", "llama2")


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime", *args], capture_output=True, text=True, timeout=300)


def test_generate_json_matches_api(ckpt):
    r = cli("generate", "--model", str(ckpt), "--prompt-ids", "0,5,9,33", "--max-tokens", "12", "--draft", "lookup",
            "--temperature", "0.8", "--top-k", "20", "--seed", "3", "--ignore-eos", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    ref = runtime.load(ckpt, draft="lookup").generate([0, 5, 9, 33], max_tokens=12, temperature=0.8, top_k=20,
                                                     seed=3, ignore_eos=True)
    assert out["token_ids"] == list(ref.token_ids) and out["text"] == ref.text
    assert out["stats"]["drafter"] == "lookup" and out["stats"]["generated_tokens"] == 12
    assert {"tau", "accepted_per_step", "time_draft", "time_verify", "time_other", "target_forwards"} <= set(out["stats"])


def test_generate_streams_text(ckpt):
    r = cli("generate", "--model", str(ckpt), "--prompt", "The quick brown fox", "--max-tokens", "8", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    ref = runtime.load(ckpt).generate("The quick brown fox", max_tokens=8, ignore_eos=True)
    assert r.stdout == ref.text
    assert "tau" in r.stderr and "[length]" in r.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (["--prompt", "hi", "--top-p", "1.5"], "top_p"),
        (["--prompt", "hi", "--draft", "lookup", "--tree", "[[0, 0]]"], "[0]"),
        (["--prompt", "hi", "--tree", "chain-2"], "root-only"),
        (["--prompt-ids", "0,99999"], "token ids"),
        (["--prompt", "hi", "--draft", "medusa"], "draft_model: required for drafter 'medusa'"),
        (["--prompt", "hi", "--draft", "lookup", "--draft-option", "bogus=1"], "unknown option"),
    ],
)
def test_bad_input_exits_2_with_message(ckpt, args, message):
    r = cli("generate", "--model", str(ckpt), *args)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_missing_model_dir(tmp_path):
    r = cli("generate", "--model", str(tmp_path / "nope"), "--prompt", "hi")
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_device_is_validated(ckpt):
    r = cli("generate", "--model", str(ckpt), "--prompt", "hi", "--device", "tpu:x")
    assert r.returncode == 2 and "device" in r.stderr
