"""Sharding on 8 simulated CPU devices (tests/conftest.py): rules table, sharded load/init, equal to 1 device."""

import numpy as np
import pytest

import jax
from jax.sharding import PartitionSpec as P

from helpers_hf import left_pad, save_tiny_qwen3, tiny_qwen3_config
from wmrl_jax import models
from wmrl_jax.models import qwen3, sharding

PROMPTS = [[5, 17, 33, 200, 41, 7], [8, 9, 250], [1, 2], [3, 4, 5, 6]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # 4 heads, 2 KV heads, hidden 32, MLP 48, vocab 320: KV heads do not divide over 4 tensor shards.
    return save_tiny_qwen3(tmp_path_factory.mktemp("ckpt"), tiny_qwen3_config(), seed=11, tokenizer=False)


@pytest.fixture(scope="module")
def reference(checkpoint):
    tokens, mask = left_pad(PROMPTS)
    model = models.load_hf(checkpoint)
    return tokens, mask, np.asarray(model.logits(tokens, mask.astype(bool)))


def test_logical_to_spec_follows_rules_and_divisibility():
    mesh_shape = {"data": 1, "fsdp": 2, "tensor": 4}
    assert sharding.logical_to_spec(("layers", "embed", "heads", "head_dim"), (3, 32, 8, 12), mesh_shape) == P(
        None, "fsdp", "tensor", None
    )
    # 2 KV heads on 4 tensor shards: replicated rather than an error.
    assert sharding.logical_to_spec(("layers", "embed", "kv_heads", "head_dim"), (3, 32, 2, 12), mesh_shape) == P(
        None, "fsdp", None, None
    )
    # batch -> (data, fsdp): 6 rows take data (1) and fsdp (2); 3 rows only data.
    assert sharding.logical_to_spec(("batch", "length"), (6, 5), mesh_shape) == P(("data", "fsdp"), None)
    assert sharding.logical_to_spec(("batch", "length"), (3, 5), mesh_shape) == P("data", None)
    # A mesh axis is used once per array; axes the mesh lacks are ignored.
    assert sharding.logical_to_spec(("mlp", "vocab"), (8, 8), {"tensor": 4}) == P("tensor", None)
    with pytest.raises(KeyError, match="logical axis 'bogus' has no sharding rule"):
        sharding.logical_to_spec(("bogus",), (4,), mesh_shape)
    with pytest.raises(ValueError, match=r"do not match array rank 1 \(shape \(4,\)\)"):
        sharding.logical_to_spec(("embed", "mlp"), (4,), mesh_shape)


def test_make_mesh_validates():
    mesh = sharding.make_mesh((1, 2, 4))
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "tensor": 4}
    with pytest.raises(ValueError, match=r"needs 16 devices, only 8 available"):
        sharding.make_mesh((2, 2, 4))
    with pytest.raises(ValueError, match=r"unknown mesh axes \['model'\]"):
        sharding.make_mesh((2, 4), ("fsdp", "model"))
    with pytest.raises(ValueError, match=r"shape \(8,\) has 1 dims, axes"):
        sharding.make_mesh((8,))


@pytest.mark.parametrize("shape", [(2, 4), (8, 1)], ids=["fsdp2_tensor4", "fsdp8_tensor1"])
def test_sharded_load_matches_one_device(checkpoint, reference, shape):
    tokens, mask, want = reference
    mesh = sharding.make_mesh(shape, ("fsdp", "tensor"))
    model = models.load_hf(checkpoint, mesh=mesh)
    fsdp, tensor = shape
    layers = model.params["layers"]
    # Check the placement itself, not only the values.
    assert layers["q_proj_dnh"].sharding.spec == P(None, "fsdp", "tensor", None)
    # 2 KV heads split over a tensor axis of 1, not of 4.
    assert layers["k_proj_dkh"].sharding.spec == P(None, "fsdp", "tensor" if tensor == 1 else None, None)
    assert layers["down_proj_fd"].sharding.spec == P(None, "tensor", "fsdp")
    assert model.params["embed_vd"].sharding.spec == P("tensor", "fsdp")
    assert model.params["lm_head_dv"].sharding.spec == P("fsdp", "tensor")
    assert {s.data.shape for s in layers["q_proj_dnh"].addressable_shards} == {(2, 32 // fsdp, 4 // tensor, 12)}
    assert len(layers["q_proj_dnh"].addressable_shards) == 8
    got = np.asarray(model.logits(tokens, mask.astype(bool)))
    assert np.max(np.abs(got - want) * mask[..., None]) < 1e-5


def test_sharded_init_places_params():
    cfg = qwen3.config_from_hf(tiny_qwen3_config(num_hidden_layers=1).to_dict())
    mesh = sharding.make_mesh((1, 2, 4))
    model = models.init(cfg, jax.random.key(0), mesh=mesh)
    assert model.params["layers"]["up_proj_df"].sharding.spec == P(None, "fsdp", "tensor")
    assert model.params["final_norm_d"].sharding.spec == P(None)
    single = models.init(cfg, jax.random.key(0))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), model.params, single.params)
    specs = sharding.logical_to_sharding(qwen3.cache_axes(cfg), mesh, jax.eval_shape(lambda: qwen3.init_cache(cfg, 4, 16)))
    assert specs["k"].spec == P(None, ("data", "fsdp"), None, None, None) and specs["index"].spec == P()
