"""Checkpoint loading and ModelConfig parsing: every bad input raises a spectree error naming the problem."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.checkpoint import expected_shapes, load_checkpoint, load_tensors
from runtime.config import ModelConfig, RopeScaling
from runtime.errors import CheckpointError, ConfigError, SpectreeError
from runtime.model import TargetModel
from runtime.rope import inverse_frequencies
from tests.tiny import make_checkpoint

LLAMA31_CONFIG = {  # Llama-3.1-8B's config.json (older format: top-level rope_theta, rope_scaling, torch_dtype)
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("base"), "llama2")


@pytest.fixture
def ckpt(base, tmp_path):
    """A fresh, editable copy of the base checkpoint."""
    return shutil.copytree(base, tmp_path / "ckpt")


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def rewrite_weights(path, fn):
    tensors = load_file(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


# ---- config ----------------------------------------------------------------------------------------------


def test_config_old_format_llama31():
    cfg = ModelConfig.from_hf(LLAMA31_CONFIG)
    assert cfg.architecture == "LlamaForCausalLM"
    assert cfg.head_dim == 128 and cfg.num_key_value_heads == 8
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert cfg.dtype == "bfloat16" and cfg.torch_dtype == torch.bfloat16
    assert cfg.eos_token_ids == (128001, 128008, 128009) and cfg.bos_token_id == 128000
    assert cfg.max_context == 131072 and cfg.sliding_window is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.vocab_size = 1  # type: ignore[misc]


def test_config_new_format_and_generation_config(tmp_path):
    path = make_checkpoint(tmp_path, "llama3")
    raw = json.loads((path / "config.json").read_text())
    assert "rope_parameters" in raw and "rope_scaling" not in raw  # transformers 5 format
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3], "bos_token_id": 0}))
    cfg = ModelConfig.from_hf(path)
    assert cfg.rope_scaling.rope_type == "llama3" and cfg.rope_scaling.original_max_position_embeddings == 64
    assert cfg.rope_theta == 500000.0
    assert cfg.eos_token_ids == (2, 3, 1)  # generation_config first, then config.json's [1, 2]


def test_config_architecture_specifics():
    qwen = dict(LLAMA31_CONFIG, architectures=["Qwen2ForCausalLM"], sliding_window=4096, use_sliding_window=False)
    cfg = ModelConfig.from_hf(qwen)
    assert cfg.attention_bias and not cfg.o_proj_bias and cfg.max_context == 131072
    assert ModelConfig.from_hf(dict(qwen, use_sliding_window=True)).max_context == 4096
    mistral = dict(LLAMA31_CONFIG, architectures=["MistralForCausalLM"], sliding_window=4096)
    assert ModelConfig.from_hf(mistral).max_context == 4096
    no_head_dim = {k: v for k, v in LLAMA31_CONFIG.items() if k != "head_dim"}
    assert ModelConfig.from_hf(dict(no_head_dim, hidden_size=2048)).head_dim == 64
    assert ModelConfig.from_hf(dict(LLAMA31_CONFIG, head_dim=64)).head_dim == 64
    assert ModelConfig.from_hf(LLAMA31_CONFIG).with_dtype("fp16").dtype == "float16"
    llama_bias = ModelConfig.from_hf(dict(LLAMA31_CONFIG, attention_bias=True))
    assert llama_bias.attention_bias and llama_bias.o_proj_bias


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope scaling type 'yarn'"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "unsupported rope scaling type 'dynamic'"),
        ({"rope_scaling": {"rope_type": "linear"}}, "positive number factor"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"num_key_value_heads": 5}, "multiple of num_key_value_heads"),
        ({"torch_dtype": "int8"}, "unsupported dtype 'int8'"),
        ({"vocab_size": None}, "missing required field 'vocab_size'"),
        ({"eos_token_id": [1, "x"]}, "eos_token_id"),
        ({"sliding_window": -3}, "sliding_window"),
        ({"num_hidden_layers": 0}, "num_hidden_layers: got 0, expected an integer >= 1"),
        ({"intermediate_size": True}, "intermediate_size: got True, expected an integer"),
    ],
)
def test_config_errors(changes, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(dict(LLAMA31_CONFIG, **changes))


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64},
        {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192},
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "default"},
    ],
)
@pytest.mark.parametrize("head_dim,theta", [(16, 500000.0), (128, 500000.0), (64, 10000.0)])
def test_inverse_frequencies_equal_transformers(params, head_dim, theta):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4, rope_parameters=dict(params, rope_theta=theta)
    )
    raw = json.loads(hf.to_json_string())
    cfg = ModelConfig.from_hf(dict(raw, architectures=["LlamaForCausalLM"], vocab_size=32))
    ours = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    if params["rope_type"] == "default":
        assert cfg.rope_scaling is None
        expected = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    else:
        expected, attention_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf, "cpu")
        assert attention_factor == 1.0
    assert ours.dtype == torch.float32
    assert torch.equal(ours, expected)


# ---- checkpoint errors -----------------------------------------------------------------------------------


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match="missing config.json"):
        TargetModel.from_pretrained(ckpt)


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        TargetModel.from_pretrained(tmp_path / "nope")


def test_missing_weights(ckpt):
    (ckpt / "model.safetensors").rename(ckpt / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="missing weights.*model.safetensors.*found pytorch_model.bin"):
        TargetModel.from_pretrained(ckpt)


def test_missing_shard(tmp_path):
    path = make_checkpoint(tmp_path, "llama2", sharded=True)
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"missing: {shard.name}"):
        TargetModel.from_pretrained(path)


def test_index_lists_tensor_absent_from_shard(tmp_path):
    path = make_checkpoint(tmp_path, "llama2", sharded=True)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    name, shard = "model.norm.weight", index["weight_map"]["model.norm.weight"]
    tensors = load_file(path / shard)
    del tensors[name]
    save_file(tensors, path / shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"missing from their shard: {name} \\(in {shard}\\)"):
        load_tensors(path)


@pytest.mark.parametrize("keep_bytes", [5, 100, -64])
def test_truncated_safetensors(ckpt, keep_bytes):
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[:keep_bytes])
    with pytest.raises(CheckpointError, match="corrupt or truncated safetensors file .*model.safetensors"):
        TargetModel.from_pretrained(ckpt)


def test_missing_tensor(ckpt):
    rewrite_weights(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match="missing tensors: model.layers.1.mlp.up_proj.weight"):
        TargetModel.from_pretrained(ckpt)


def test_extra_tensor(ckpt):
    rewrite_weights(ckpt, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}))
    with pytest.raises(CheckpointError, match="unexpected tensors: model.layers.0.self_attn.q_proj.bias"):
        TargetModel.from_pretrained(ckpt)


def test_wrong_shape(ckpt):
    rewrite_weights(ckpt, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)}))
    with pytest.raises(
        CheckpointError, match=r"model.layers.0.self_attn.k_proj.weight has shape \(64, 64\), expected \(32, 64\)"
    ):
        TargetModel.from_pretrained(ckpt)


def test_unknown_architecture_in_checkpoint(ckpt):
    edit_config(ckpt, architectures=["FalconForCausalLM"])
    with pytest.raises(SpectreeError, match="'FalconForCausalLM'.*supported: LlamaForCausalLM, MistralForCausalLM"):
        TargetModel.from_pretrained(ckpt)


def test_untied_without_lm_head(ckpt):
    rewrite_weights(ckpt, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match="missing tensors: lm_head.weight"):
        TargetModel.from_pretrained(ckpt)


def test_tied_without_lm_head_loads_tied(ckpt):
    rewrite_weights(ckpt, lambda t: t.pop("lm_head.weight"))
    edit_config(ckpt, tie_word_embeddings=True)
    model = TargetModel.from_pretrained(ckpt)
    assert model.lm_head_weight is model.model.embed_tokens.weight


def test_tied_with_different_lm_head(ckpt):
    edit_config(ckpt, tie_word_embeddings=True)
    with pytest.raises(CheckpointError, match="tie_word_embeddings is true but lm_head.weight differs"):
        TargetModel.from_pretrained(ckpt)


def test_tied_with_identical_lm_head_and_old_buffers(ckpt):
    def fn(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)  # old checkpoints carry these

    rewrite_weights(ckpt, fn)
    edit_config(ckpt, tie_word_embeddings=True)
    config, tensors = load_checkpoint(ckpt)
    assert "lm_head.weight" not in tensors and not any("inv_freq" in n for n in tensors)
    assert set(tensors) == set(expected_shapes(config))


def test_load_dtype_conversion(ckpt):
    config, tensors = load_checkpoint(ckpt, dtype="float16")
    assert config.dtype == "float16"
    assert {t.dtype for t in tensors.values()} == {torch.float16}
    config, tensors = load_checkpoint(ckpt, dtype="bfloat16", runs_here=False)  # a conversion: any CPU
    assert config.dtype == "bfloat16"
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
