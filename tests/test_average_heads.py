"""`python -m builder average-heads`: the weighted mean of draft heads (a model soup) is a head the runtime loads,
drafts with losslessly, and whose files say what went into it; heads that cannot be averaged are refused by name."""

from __future__ import annotations

import json

import pytest
import torch

import runtime
from builder.__main__ import main as builder_main
from builder.average_heads import SUMMARY_FILE, average_heads
from builder.config import BuildConfigError
from runtime.decode import SpecDecoder
from runtime.draft_spec import DraftSpec, LookupOptions
from runtime.drafters import load_drafter
from runtime.drafters.datastore import DATASTORE_FILE, Datastore, save_tokens
from runtime.drafters.draft_vocab import DraftVocab
from runtime.engine import sha256_file
from runtime.model import TargetModel
from tests.heads import write_eagle_head, write_medusa_head
from tests.tiny import make_checkpoint, vocab_size


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("target"), "llama2", seed=3)


def _state(path):
    return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)


def _with_vocab(ids):
    def hook(state):
        state.update(DraftVocab(torch.tensor(ids), vocab_size()).state())
        return state
    return hook


def test_weighted_mean_of_eagle_heads_is_a_lossless_drafter(target_dir, tmp_path):
    a = write_eagle_head(tmp_path / "a", target_dir, seed=1)
    b = write_eagle_head(tmp_path / "b", target_dir, seed=2)
    (a / "training_summary.json").write_text(json.dumps({"steps": 7}))
    r = average_heads([a, b], tmp_path / "soup", weights=[1.0, 3.0])
    assert r.kind == "eagle" and r.weights == (0.25, 0.75)
    sa, sb, soup = _state(a), _state(b), _state(tmp_path / "soup")
    assert soup.keys() == sa.keys()
    for k in sa:
        torch.testing.assert_close(soup[k], 0.25 * sa[k] + 0.75 * sb[k], rtol=1e-6, atol=1e-7)
    assert not torch.equal(soup["fc.weight"], sa["fc.weight"])  # a real mix, not a copy of either
    assert json.loads((tmp_path / "soup" / "config.json").read_text()) == json.loads((a / "config.json").read_text())
    summary = json.loads((tmp_path / "soup" / SUMMARY_FILE).read_text())
    assert [i["weight"] for i in summary["ingredients"]] == [0.25, 0.75]
    assert summary["ingredients"][0]["sha256"] == sha256_file(a / "pytorch_model.bin")
    assert summary["ingredients"][0]["training_summary"] == {"steps": 7}
    assert summary["sha256"] == sha256_file(tmp_path / "soup" / "pytorch_model.bin")
    assert not (tmp_path / "soup" / DATASTORE_FILE).exists()  # neither ingredient had one

    # the runtime drafts with it, and greedy output is plain decoding's
    model = TargetModel.from_pretrained(target_dir)
    drafter = load_drafter(DraftSpec("eagle", path=tmp_path / "soup"), model)
    prompt = [0, 5, 9, 33, 7, 5, 9, 33, 12, 40]
    plain = runtime.load(str(target_dir), draft="none").generate(prompt, max_tokens=24, ignore_eos=True)
    spec = SpecDecoder(model, None, drafter, 16).generate(prompt, max_tokens=24, ignore_eos=True)
    assert spec.token_ids == plain.token_ids


def test_reduced_vocabulary_and_datastore_travel(target_dir, tmp_path):
    ids = list(range(0, vocab_size(), 2))
    sized = {"draft_vocab_size": len(ids)}
    a = write_eagle_head(tmp_path / "a", target_dir, seed=1, state_hook=_with_vocab(ids), config_overrides=sized)
    b = write_eagle_head(tmp_path / "b", target_dir, seed=2, state_hook=_with_vocab(ids), config_overrides=sized)
    save_tokens(a / DATASTORE_FILE, Datastore.from_answers([[5, 6, 7, 8], [5, 6, 7, 9]]).tokens)
    own = tmp_path / "other.npz"
    save_tokens(own, Datastore.from_answers([[1, 2, 3]]).tokens)
    average_heads([a, b], tmp_path / "first", weights=[1, 1])
    assert (tmp_path / "first" / DATASTORE_FILE).read_bytes() == (a / DATASTORE_FILE).read_bytes()
    average_heads([a, b], tmp_path / "given", datastore=own)
    assert (tmp_path / "given" / DATASTORE_FILE).read_bytes() == own.read_bytes()
    soup = _state(tmp_path / "given")
    assert torch.equal(soup["d2t"], _state(a)["d2t"]) and torch.equal(soup["t2d"], _state(a)["t2d"])
    model = TargetModel.from_pretrained(target_dir)
    spec = DraftSpec("eagle", path=tmp_path / "first", lookup=LookupOptions(datastore_tokens=4))
    assert load_drafter(spec, model) is not None  # the reduced vocabulary and the datastore load as a head's

    # in place: the output may be one of the heads (with --force); its datastore stays
    before = _state(a)
    average_heads([a, b], a, force=True)
    assert (a / DATASTORE_FILE).is_file()
    torch.testing.assert_close(_state(a)["fc.weight"], 0.5 * before["fc.weight"] + 0.5 * _state(b)["fc.weight"])


def test_medusa_heads_average(tmp_path):
    a = write_medusa_head(tmp_path / "a", 16, 64, num_heads=2, seed=1)
    b = write_medusa_head(tmp_path / "b", 16, 64, num_heads=2, seed=2)
    r = average_heads([a, b], tmp_path / "soup")
    assert r.kind == "medusa"
    from safetensors.torch import load_file

    sa, sb = load_file(str(a / "medusa_lm_head.safetensors")), load_file(str(b / "medusa_lm_head.safetensors"))
    soup = load_file(str(tmp_path / "soup" / "medusa_lm_head.safetensors"))
    for k in sa:
        torch.testing.assert_close(soup[k], 0.5 * sa[k] + 0.5 * sb[k])


def test_refusals_name_what_is_wrong(target_dir, tmp_path):
    a = write_eagle_head(tmp_path / "a", target_dir, seed=1, state_hook=_with_vocab([0, 2, 4, 6]))
    other_vocab = write_eagle_head(tmp_path / "v", target_dir, seed=2, state_hook=_with_vocab([0, 2, 4, 8]))
    with pytest.raises(BuildConfigError, match="d2t differs"):
        average_heads([a, other_vocab], tmp_path / "x")
    other_cfg = write_eagle_head(tmp_path / "c", target_dir, seed=2, state_hook=_with_vocab([0, 2, 4, 6]),
                                 config_overrides={"rms_norm_eps": 1e-3})
    with pytest.raises(BuildConfigError, match=r"differs .* in \['rms_norm_eps'\]"):
        average_heads([a, other_cfg], tmp_path / "x")
    medusa = write_medusa_head(tmp_path / "m", 16, 64, num_heads=2)
    with pytest.raises(BuildConfigError, match="mixes kinds"):
        average_heads([a, medusa], tmp_path / "x")
    with pytest.raises(BuildConfigError, match="--weights: got 1 values for 2 heads"):
        average_heads([a, a], tmp_path / "x", weights=[1.0])
    with pytest.raises(BuildConfigError, match=r"--weights: got \[1.0, -1.0\]"):
        average_heads([a, a], tmp_path / "x", weights=[1.0, -1.0])
    with pytest.raises(BuildConfigError, match="expected two or more"):
        average_heads([a], tmp_path / "x")
    with pytest.raises(BuildConfigError, match="not a draft head directory"):
        average_heads([a, tmp_path], tmp_path / "x")
    (tmp_path / "taken").mkdir()
    with pytest.raises(BuildConfigError, match="--output: .*taken exists"):
        average_heads([a, a], tmp_path / "taken")
    with pytest.raises(BuildConfigError, match="is one of --heads"):
        average_heads([a, a], a)
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a datastore")
    with pytest.raises(BuildConfigError, match="--datastore: .*bad.npz"):
        average_heads([a, a], tmp_path / "x", datastore=bad)
    assert not (tmp_path / "x").exists()  # nothing half-written


def test_cli(target_dir, tmp_path, capsys):
    a = write_eagle_head(tmp_path / "a", target_dir, seed=1)
    b = write_eagle_head(tmp_path / "b", target_dir, seed=2)
    assert builder_main(["average-heads", "--heads", str(a), str(b), "--output", str(tmp_path / "s")]) == 0
    assert "averaged eagle head written" in capsys.readouterr().out
    assert builder_main(["average-heads", "--heads", str(a), str(b), "--weights", "0", "1",
                         "--output", str(tmp_path / "t")]) == 2
    assert "--weights: got [0.0, 1.0]; expected positive finite numbers" in capsys.readouterr().err


def test_shipped_heads_are_what_their_provenance_names():
    """Every file of the heads that ship (demo/smollm2/eagle, medusa) has the sha256 demo/smollm2/provenance.json
    gives, no file there is unlisted, and eagle/averaging.json names the same weights and the ingredients
    provenance.json says were averaged (their weights: git show a6bc875:demo/smollm2/)."""
    from pathlib import Path

    smollm2 = Path(__file__).resolve().parents[1] / "demo" / "smollm2"
    provenance = json.loads((smollm2 / "provenance.json").read_text())
    assert set(provenance["heads"]) == {"eagle", "medusa"}
    for name, head in provenance["heads"].items():
        on_disk = {p.name for p in (smollm2 / name).iterdir()}
        assert on_disk == set(head["files"]), name
        for file, digest in head["files"].items():
            assert sha256_file(smollm2 / name / file) == digest, f"{name}/{file} is not the file provenance.json names"
    summary = json.loads((smollm2 / "eagle" / SUMMARY_FILE).read_text())
    assert summary["sha256"] == provenance["heads"]["eagle"]["files"][summary["weights_file"]]
    made = {step["output"]: step for step in provenance["heads"]["eagle"]["made_by"]}
    assert [(i["path"], i["sha256"]) for i in summary["ingredients"]] == [
        (f"demo/smollm2/{i}", made[i]["pytorch_model.bin"]) for i in ("eagle-base-prose", "eagle-fresh")]
