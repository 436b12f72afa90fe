"""The rollout layout (wmrl_jax/train/rollout.py) on 8 simulated CPU devices (tests/conftest.py).

* The decode loop of the compiled sampler all-gathers weights for every token
  on the training layout (fsdp 4 x tensor 2) and not on the rollout layout
  (counted in the optimised HLO, `plan.decode_loop_all_gathers`).
* Greedy generation from the resharded weights gives the same tokens as from
  the training layout, and the reshard is a cast and a move, nothing else.
* The bill (`train.bill`) prices the training layout's per-token gathers.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from wmrl_jax import micro_world, sampling
from wmrl_jax.models import load_hf, make_mesh
from wmrl_jax.models.sharding import shard_params
from wmrl_jax.train import bill, plan, rollout

PROMPTS = [[5, 17, 33, 200, 41, 7], [8, 9, 250], [1, 2], [3, 4, 5, 6], [9, 9, 9], [100, 101], [7], [12, 13, 14, 15]]


@pytest.fixture(scope="module")
def model():
    return load_hf(micro_world.shipped_path())          # float32, one device


@pytest.fixture(scope="module")
def train_mesh():
    return make_mesh((1, 4, 2))


def _compiled_decode_gathers(model, mesh, params):
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
    program, _ = plan.compile_sampler("sample", None, model.family, model.config, mesh, abstract, 8, 32, 8,
                                      temperature=1.0, top_p=1.0, top_k=1)
    return program.decode_gathers


def test_rollout_layout_has_no_weight_all_gather_in_the_decode_loop(model, train_mesh):
    trained = shard_params(model.params, model.family.param_axes(model.config), train_mesh)
    fsdp = _compiled_decode_gathers(model, train_mesh, trained)
    print("training layout (fsdp 4 x tensor 2):", fsdp)
    assert fsdp["loops"] == 1
    # Every layer's weights are gathered again for every token: the projections of both layer kinds and the MLP.
    assert fsdp["weight_all_gathers"] >= 10 and fsdp["weight_gather_bytes"] > 1e6
    for g in (1, 2):
        mesh = rollout.rollout_mesh({"layout": "rollout", "tensor": g}, jax.devices())
        assert dict(mesh.shape) == {"data": 8 // g, "fsdp": 1, "tensor": g}
        params = rollout.Resharder(model.family, model.config, mesh, jnp.float32)(trained)
        gathers = _compiled_decode_gathers(model, mesh, params)
        print(f"rollout layout, tensor {g}:", gathers)
        assert gathers["loops"] == 1
        assert gathers["weight_all_gathers"] == 0 and gathers["weight_gather_bytes"] == 0
        # What is left is the sampler's own: the logits gathered over the vocabulary for top-k.
        assert gathers["all_gathers"] <= 2


def test_greedy_tokens_are_the_same_on_both_layouts(model, train_mesh):
    trained = shard_params(model.params, model.family.param_axes(model.config), train_mesh)
    kw = dict(max_new_tokens=24, temperature=1.0, top_k=1, seed=3)
    expect = sampling.generate(dataclasses.replace(model, params=trained, mesh=train_mesh), PROMPTS, **kw)
    for g in (1, 2, 4):
        mesh = rollout.rollout_mesh({"layout": "rollout", "tensor": g}, jax.devices())
        resharder = rollout.Resharder(model.family, model.config, mesh, jnp.float32)
        params = resharder(trained)
        want = rollout.rollout_shardings(mesh, model.family, model.config, params)
        for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
            assert x.sharding.is_equivalent_to(s, x.ndim)
        got = sampling.generate(dataclasses.replace(model, params=params, mesh=mesh), PROMPTS, **kw)
        assert got.tokens == expect.tokens, g
        np.testing.assert_allclose(np.concatenate(got.logprobs), np.concatenate(expect.logprobs), atol=1e-4)


def test_reshard_to_bf16_is_the_cast_moved(model, train_mesh):
    trained = shard_params(model.params, model.family.param_axes(model.config), train_mesh)
    mesh = rollout.rollout_mesh({"layout": "rollout", "tensor": 2}, jax.devices())
    resharder = rollout.Resharder(model.family, model.config, mesh, jnp.bfloat16)
    assert repr(resharder).startswith("Resharder(") and "dtype=bfloat16" in repr(resharder)
    out = resharder(trained)
    for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(model.params)):
        assert x.dtype == jnp.bfloat16 and x.sharding.mesh.shape == mesh.shape
        np.testing.assert_array_equal(np.asarray(x.astype(jnp.float32)),
                                      np.asarray(y.astype(jnp.bfloat16).astype(jnp.float32)))
    # The frozen copy's one-time placement gives the same arrays, from params on one device.
    placed = rollout.place(model.params, mesh, model.family, model.config, jnp.bfloat16)
    for x, y in zip(jax.tree.leaves(placed), jax.tree.leaves(out)):
        assert x.sharding.is_equivalent_to(y.sharding, x.ndim)
        np.testing.assert_array_equal(np.asarray(x.astype(jnp.float32)), np.asarray(y.astype(jnp.float32)))


def test_bad_rollout_config_names_the_field():
    with pytest.raises(ValueError, match=r"config.rollout.layout: 'fsdp', expected one of \('rollout', 'train'\)"):
        rollout.rollout_mesh_shape({"layout": "fsdp", "tensor": 1}, 8)
    with pytest.raises(ValueError, match=r"config.rollout.tensor: 3, expected a positive int dividing the 8"):
        rollout.rollout_mesh_shape({"layout": "rollout", "tensor": 3}, 8)
    assert rollout.rollout_mesh_shape({"layout": "train", "tensor": 3}, 8) is None
    assert rollout.rollout_mesh_shape({"layout": "rollout", "tensor": 4}, 8) == (2, 1, 4)


def test_bill_prices_the_per_token_gathers_and_the_ideal_below_it():
    from wmrl_jax.models import qwen35

    cfg = qwen35.PRESETS["qwen3.5-9b"]
    shapes = jax.eval_shape(lambda: qwen35.init_params(cfg, jax.random.key(0), jnp.bfloat16))
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    m = bill.ModelCosts.of(cfg, n)
    assert 8.9e9 < n < 9.1e9 and m.n_matmul == n - cfg.vocab_size * cfg.hidden_size
    # The paper's caps on 8 devices, fsdp 2 x tensor 4.
    w = bill.Workload(batch=64, rows=64, prompt=2936, turns=4, reply=4096, observation=1088, train_width=22784,
                      micro_batches=32, wm_calls=4, wm_rows=64, wm_samples=1, wm_prompt=5543, wm_new=1024)
    hw = bill.Hardware()
    train = bill.bill(m, w, bill.Layout(8, 1, 2, 4, False, 1), hw, 3200)
    roll = bill.bill(m, w, bill.Layout(8, 1, 2, 4, True, 4), hw, 3200)
    # The training layout's decode: every token gathers (fsdp - 1) / fsdp of the bf16 weights / tensor over the
    # links: 4096 tokens x 4 turns x 3200 steps of at least that, on 8 devices.
    gather_s = 0.5 * 2 * m.n_matmul / 4 / 300e9
    assert train["phases"]["agent decode"]["floor_hours"] >= 4096 * 4 * 3200 * gather_s * 8 / 3600
    assert roll["phases"]["agent decode"]["hours"] < 0.7 * train["phases"]["agent decode"]["hours"]
    for b in (train, roll):
        assert b["hours_ideal"] < b["hours_total"]
        assert set(b["phases"]) == set(bill.PHASES)
        for p in b["phases"].values():
            assert p["hours"] == pytest.approx(max(p["compute_hours"], p["floor_hours"]))
    # The ideal's update is 8N a trained token (+ attention) at the MFU: 6N alone is the issue's ~494 h.
    six_n = 6 * m.n_matmul * 64 * w.trained_tokens * 3200 / (312e12 * 0.4) / 3600
    assert 0.75 * 494 < six_n < 494 * 1.05
    assert roll["ideal_phases"]["update"] > 8 / 6 * six_n
    # The paper's budget: the ideal equals the paper's hours at the scaled tokens.
    budget = bill.paper_budget(m, w, bill.Layout(8, 1, 2, 4, True, 4), hw, 3200, 349)
    assert 0 < budget["scale"] < 1 and budget["hours_ideal"] == pytest.approx(349, rel=1e-3)
