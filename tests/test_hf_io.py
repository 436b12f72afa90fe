"""HF checkpoint I/O: load/save round trips through transformers, sharded sets, errors, tokenizer."""

import json
import shutil

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

import jax

from helpers_hf import build_tiny_qwen3, hf_logits, left_pad, save_tiny_qwen3, tiny_qwen3_config
from wmrl_jax import models
from wmrl_jax.models import hf_io, qwen3

PROMPTS = [[5, 17, 33, 200, 41, 7], [8, 9, 250]]


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    return save_tiny_qwen3(tmp_path_factory.mktemp("untied"), tiny_qwen3_config(), seed=3)


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    cfg = tiny_qwen3_config(tie_word_embeddings=True, num_key_value_heads=1)
    return save_tiny_qwen3(tmp_path_factory.mktemp("tied"), cfg, seed=4, tokenizer=False)


def _load_hf_torch(path, dtype=torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()


@pytest.mark.parametrize("which", ["untied", "tied"])
def test_save_hf_round_trip_through_transformers_is_exact(which, request, tmp_path):
    src = request.getfixturevalue(which)
    tokenizer = models.load_tokenizer(src) if which == "untied" else None
    out = models.save_hf(models.load_hf(src), tmp_path / "out", tokenizer=tokenizer)
    original, reloaded = _load_hf_torch(src), _load_hf_torch(out)
    assert type(reloaded).__name__ == "Qwen3ForCausalLM"
    for key, value in original.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], value), key
    tokens, mask = left_pad(PROMPTS)
    np.testing.assert_array_equal(hf_logits(reloaded, tokens, mask), hf_logits(original, tokens, mask))
    stored = safetensors.numpy.load_file(out / "model.safetensors")
    assert ("lm_head.weight" in stored) == (which == "untied")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] == (which == "tied")
    if tokenizer is not None:
        text = "<|im_start|>user\nscore = 0.5<|im_end|>\n"
        assert transformers.AutoTokenizer.from_pretrained(out)(text)["input_ids"] == tokenizer(text)["input_ids"]


def test_hf_sharded_checkpoint_loads(tmp_path):
    cfg = tiny_qwen3_config(num_key_value_heads=1)
    path = save_tiny_qwen3(tmp_path / "sharded", cfg, seed=5, max_shard_size="20KB", tokenizer=False)
    assert (path / "model.safetensors.index.json").exists() and not (path / "model.safetensors").exists()
    tokens, mask = left_pad(PROMPTS)
    ours = np.asarray(models.load_hf(path).logits(tokens, mask.astype(bool)))
    ref = hf_logits(build_tiny_qwen3(cfg, seed=5), tokens, mask)
    assert np.max(np.abs(ours - ref) * mask[..., None]) < 1e-4


def test_save_hf_sharded_and_bf16_load_in_transformers(untied, tmp_path):
    model = models.load_hf(untied, dtype="bfloat16")
    out = models.save_hf(model, tmp_path / "bf16", max_shard_bytes=30_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    reloaded = _load_hf_torch(out, dtype="auto")
    original = _load_hf_torch(untied)
    assert reloaded.dtype == torch.bfloat16
    for key, value in original.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], value.to(torch.bfloat16)), key


def test_safetensors_codec_agrees_with_the_safetensors_library(untied, tmp_path):
    reference = safetensors.numpy.load_file(untied / "model.safetensors")
    reader = hf_io.SafetensorsFile(untied / "model.safetensors")
    assert sorted(reader.keys()) == sorted(reference)
    for key, value in reference.items():
        np.testing.assert_array_equal(reader.get(key), value)
    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.asarray([1.5, -2.0], ml_dtypes.bfloat16)}
    hf_io.write_safetensors(tmp_path / "x.safetensors", [(k, v.shape, v.dtype, lambda v=v: v) for k, v in arrays.items()])
    with safetensors.safe_open(tmp_path / "x.safetensors", framework="pt") as f:
        np.testing.assert_array_equal(f.get_tensor("a").numpy(), arrays["a"])
        assert f.get_tensor("b").dtype == torch.bfloat16
        np.testing.assert_array_equal(f.get_tensor("b").float().numpy(), [1.5, -2.0])


def _rewrite(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = safetensors.numpy.load_file(dst / "model.safetensors")
    edit(tensors)
    safetensors.numpy.save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_bad_checkpoints_raise_errors_naming_the_tensor(tied, tmp_path):
    key = "model.layers.1.mlp.up_proj.weight"

    def misshape(t):
        t[key] = np.zeros((64, 32), np.float32)

    with pytest.raises(ValueError, match=r"tensor model\.layers\.1\.mlp\.up_proj\.weight: shape \(64, 32\), expected \(48, 32\)"):
        models.load_hf(_rewrite(tied, tmp_path / "shape", misshape))
    with pytest.raises(ValueError, match=r"missing tensor\(s\): model\.layers\.1\.mlp\.up_proj\.weight \(expected shape \(48, 32\)\)"):
        models.load_hf(_rewrite(tied, tmp_path / "missing", lambda t: t.pop(key)))

    def extra(t):
        t["model.layers.0.self_attn.rotary.weight"] = np.zeros((3,), np.float32)

    with pytest.raises(ValueError, match=r"unexpected tensor\(s\): model\.layers\.0\.self_attn\.rotary\.weight \(shape \(3,\)\); the 'qwen3' table"):
        models.load_hf(_rewrite(tied, tmp_path / "extra", extra))

    unsupported = shutil.copytree(tied, tmp_path / "llama")
    config = json.loads((unsupported / "config.json").read_text())
    (unsupported / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(ValueError, match=r"unsupported model_type 'llama'; supported: \['qwen2', 'qwen3', 'qwen3_5', 'qwen3_5_text'\]"):
        models.load_hf(unsupported)
    with pytest.raises(FileNotFoundError, match="expected model.safetensors or model.safetensors.index.json"):
        (tmp_path / "empty").mkdir()
        shutil.copy(tied / "config.json", tmp_path / "empty" / "config.json")
        models.load_hf(tmp_path / "empty")
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        models.get_family("llama")


def test_load_tokenizer_applies_the_chat_template(untied, tmp_path):
    from tokenizers import Tokenizer

    tok = models.load_tokenizer(untied)
    messages = [{"role": "user", "content": "def train(model): return 0.87"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\ndef train(model): return 0.87<|im_end|>\n<|im_start|>assistant\n"
    raw = Tokenizer.from_file(str(untied / "tokenizer.json"))  # the tokenizers library, without transformers
    assert tok(text)["input_ids"] == raw.encode(text).ids
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|im_end|>") == 2
    assert raw.decode(raw.encode("score = 0.5").ids) == "score = 0.5"

    bare = shutil.copytree(untied, tmp_path / "bare")
    (bare / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="no chat_template"):
        models.load_tokenizer(bare)


def test_init_save_load_round_trip(tmp_path):
    cfg = qwen3.config_from_hf(tiny_qwen3_config(num_hidden_layers=1).to_dict())
    model = models.init(cfg, jax.random.key(7))
    path = models.save_hf(model, tmp_path / "init")
    reloaded = models.load_hf(path)
    assert reloaded.config == cfg
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), model.params, reloaded.params)
    tokens = np.asarray([PROMPTS[0]])
    np.testing.assert_allclose(hf_logits(_load_hf_torch(path), tokens), np.asarray(model.logits(tokens)), atol=1e-4)
