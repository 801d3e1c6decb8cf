"""Safe defaults around the serving path: resumable training states are never unpickled, builds check the
tokenizer and leave nothing behind when killed, and `model_repo render` verifies the engine's checksums."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from builder.training.loop import ResumeError, load_state, save_state
from model_repo.render import RepoOptions, render
from runtime.engine import EngineChecksumError
from tests.heads import write_medusa_head
from tests.tiny import make_checkpoint, vocab_size

ROOT = Path(__file__).parent.parent


class _Payload:
    """Unpickling this runs `touch MARKER` (what a crafted state file in a work_dir would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_pickle_in_the_work_dir_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    # The file a resumed run reads, and the pickled state name of earlier versions beside it.
    for name in ("medusa-state.safetensors", "medusa-state.pt"):
        work = tmp_path / name.replace(".", "_")
        work.mkdir()
        with open(work / name, "wb") as f:
            pickle.dump({"fingerprint": "fp", "x": _Payload(marker)}, f)
        with pytest.raises(ResumeError) as e:
            load_state(work / "medusa-state.safetensors", "fp")
        assert str(work / name) in str(e.value) and "--fresh" in str(e.value)
        assert not marker.exists(), "the pickle's payload ran"
    # A real state round-trips (tensors, nested dicts with int keys, tuples, floats) and its fingerprint is checked.
    state = {"fingerprint": "fp", "module": {"w": torch.arange(6.0).reshape(2, 3)},
             "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"betas": (0.9, 0.95)}]},
             "generator": torch.Generator().manual_seed(1).get_state(), "step": 7, "loss": 0.5}
    path = tmp_path / "ok" / "eagle-state.safetensors"
    save_state(path, state)
    back = load_state(path, "fp")
    assert torch.equal(back["module"]["w"], state["module"]["w"]) and back["step"] == 7
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)
    assert torch.equal(back["optimizer"]["state"][0]["step"], torch.tensor(3.0))
    with pytest.raises(ResumeError, match="different configuration"):
        load_state(path, "other")


def _config(root: Path, ckpt: Path) -> Path:
    heads = write_medusa_head(root / "medusa", 64, vocab_size(), num_heads=2)
    cfg = {"model": {"checkpoint": str(ckpt)},
           "draft": {"method": "medusa", "checkpoint": str(heads), "tree": {"choices": [[0], [1], [0, 0]]}},
           "build": {"output": str(root / "engine"), "onnx": False, "tensorrt": False, "max_draft_len": 8}}
    path = root / "build.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def _builder(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "builder", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, **kw)


def test_validate_and_build_load_the_tokenizer(tmp_path):
    ckpt = make_checkpoint(tmp_path / "llama2", "llama2")
    (ckpt / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "garbage"}}', encoding="utf-8")
    config = _config(tmp_path, ckpt)
    for args in (("validate", "--config", str(config)), ("build", "--config", str(config), "--quiet")):
        r = _builder(*args)
        assert r.returncode == 2, r.stderr
        assert "model.checkpoint" in r.stderr and "tokenizer.json" in r.stderr, r.stderr
    assert not (tmp_path / "engine").exists()


def test_a_killed_build_leaves_nothing_behind_after_the_next_one(tmp_path):
    config = _config(tmp_path, make_checkpoint(tmp_path / "llama2", "llama2"))
    proc = subprocess.Popen([sys.executable, "-m", "builder", "build", "--config", str(config), "--quiet"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".engine.building-*")):
        assert proc.poll() is None and time.monotonic() < deadline, "the build never started writing"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)  # no chance to clean up
    proc.wait()
    leftovers = list(tmp_path.glob(".engine.*"))
    assert leftovers, "the killed build left nothing to clean up (it finished too early?)"
    r = _builder("build", "--config", str(config), "--quiet")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "engine" / "engine.json").is_file()
    assert not list(tmp_path.glob(".engine.*")), "the killed build's temporary directory is still there"


def test_render_verifies_the_engine_checksums(tmp_path):
    config = _config(tmp_path, make_checkpoint(tmp_path / "llama2", "llama2"))
    assert _builder("build", "--config", str(config), "--quiet").returncode == 0
    engine = tmp_path / "engine"
    render(RepoOptions(engine=str(engine), output=str(tmp_path / "ok")))
    rank = engine / "trtllm_checkpoint" / "rank0.safetensors"
    data = bytearray(rank.read_bytes())
    data[-1] ^= 0xFF  # same size, one bit pattern changed: only the sha256 can tell
    rank.write_bytes(bytes(data))
    with pytest.raises(EngineChecksumError, match="trtllm_checkpoint/rank0.safetensors: sha256"):
        render(RepoOptions(engine=str(engine), output=str(tmp_path / "bad")))
    assert not (tmp_path / "bad").exists()
    render(RepoOptions(engine=str(engine), output=str(tmp_path / "skipped"), skip_checksums=True))
