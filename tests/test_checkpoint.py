"""Run checkpoints (`wmrl_jax.train.checkpoint.Checkpointer`): round trip, exact resume, damaged and
partial checkpoints, restoring into a sharded layout."""

from __future__ import annotations

import logging
import pathlib

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from wmrl_jax import corrections
from wmrl_jax.models import init, make_mesh, qwen3
from wmrl_jax.train import update
from wmrl_jax.train.checkpoint import Checkpointer

CONFIG = qwen3.Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8)
B, T = 4, 12
OPTIM = ml_collections.ConfigDict(dict(learning_rate=1e-2, warmup_steps=2, total_steps=8, weight_decay=0.01,
                                       b1=0.9, b2=0.999, grad_clip=1.0))


@pytest.fixture(scope="module")
def model():
    return init(CONFIG, jax.random.key(0))


@pytest.fixture(scope="module")
def step_fn(model):
    return update.make_train_step(model.family, CONFIG, update.make_optimizer(OPTIM), kl_coef=0.04,
                                  entropy_coef=0.002, clip_eps=0.2)


def fresh_state(model):
    return update.init_train_state(jax.tree.map(jnp.copy, model.params), update.make_optimizer(OPTIM))


def batch(step: int) -> update.Batch:
    rng = np.random.default_rng(step)
    valid = np.arange(T)[None, :] >= rng.integers(0, 3, size=(B, 1))
    return update.Batch(tokens=np.where(valid, rng.integers(3, 96, size=(B, T)), 0).astype(np.int32), valid=valid,
                        loss_mask=valid & (np.arange(T) >= 6), advantages=rng.normal(size=B).astype(np.float32),
                        weights=np.ones(B, np.float32))


def run_tree(state, seed=3):
    """What the loop checkpoints: the train state, the correction state and the PRNG key's data."""
    corr = corrections.init_correction_state(cap=64)
    return {"train": state, "corrections": corr, "rng": jax.random.key_data(jax.random.key(seed))}


def assert_equal_trees(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_round_trip(tmp_path, model, step_fn):
    state, _ = step_fn(fresh_state(model), model.params, batch(0))
    tree = run_tree(state)
    ckpt = Checkpointer(tmp_path, max_to_keep=2)
    meta = {"cursor": 17, "counters": {"real_executions": 3}, "final": {"x": float("nan")}}
    ckpt.save(1, tree, meta)
    ckpt.close()
    step, restored, got_meta = Checkpointer(tmp_path).latest(run_tree(fresh_state(model), seed=9))
    assert step == 1 and got_meta["cursor"] == 17 and got_meta["counters"] == {"real_executions": 3}
    assert np.isnan(got_meta["final"]["x"])
    assert type(restored["train"]) is update.TrainState
    assert type(restored["corrections"]) is type(tree["corrections"])
    assert int(restored["train"].step) == 1
    assert_equal_trees(restored, tree)
    assert Checkpointer(tmp_path / "empty").latest(tree) is None
    with pytest.raises(TypeError, match="meta: not JSON-able"):
        Checkpointer(tmp_path / "x").save(1, tree, {"bad": object()})


def test_resume_is_exact(tmp_path, model, step_fn):
    """4 steps straight == 2 steps, save, a new Checkpointer restores, 2 more steps: params bitwise equal."""
    straight = fresh_state(model)
    for i in range(4):
        straight, _ = step_fn(straight, model.params, batch(i))
    state = fresh_state(model)
    for i in range(2):
        state, _ = step_fn(state, model.params, batch(i))
    ckpt = Checkpointer(tmp_path)
    ckpt.save(2, run_tree(state), {"cursor": 2})
    ckpt.close()
    step, tree, meta = Checkpointer(tmp_path).latest(run_tree(fresh_state(model)))
    resumed = tree["train"]
    for i in range(step, 4):
        resumed, _ = step_fn(resumed, model.params, batch(i))
    assert int(resumed.step) == 4
    assert_equal_trees(resumed.params, straight.params)
    assert_equal_trees(resumed.opt_state, straight.opt_state)


def _save_steps(directory, model, steps):
    ckpt = Checkpointer(directory, max_to_keep=5)
    states = {}
    for s in steps:
        tree = run_tree(update.TrainState(step=jnp.int32(s), params=jax.tree.map(lambda x: x + s, model.params),
                                          opt_state=()))
        ckpt.save(s, tree, {"cursor": s})
        states[s] = tree
    ckpt.close()
    return states


def _like(model):
    return run_tree(update.TrainState(step=jnp.int32(0), params=model.params, opt_state=()))


@pytest.mark.parametrize("damage", ["truncate", "delete", "flip"])
def test_damaged_newest_falls_back_to_previous(tmp_path, model, caplog, damage):
    states = _save_steps(tmp_path, model, [1, 2])
    data = sorted((p for p in (tmp_path / "2" / "state").rglob("*") if p.is_file() and p.parent.name == "d"),
                  key=lambda p: p.stat().st_size)[-1]   # the biggest array chunk
    if damage == "truncate":
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    elif damage == "delete":
        data.unlink()
    else:   # a flipped byte that leaves the file readable
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x40
        data.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING):
        step, tree, meta = Checkpointer(tmp_path).latest(_like(model))
    assert step == 1 and meta == {"cursor": 1}
    assert_equal_trees(tree, states[1])
    assert any("/2 is damaged and was skipped" in r.getMessage() for r in caplog.records), caplog.text
    assert (tmp_path / "2.corrupt").is_dir() and not (tmp_path / "2").exists()
    # Saving step 2 again afterwards works: the damaged one no longer blocks it.
    ckpt = Checkpointer(tmp_path)
    ckpt.save(2, states[2], {"cursor": 2})
    ckpt.wait()
    assert ckpt.latest(_like(model))[0] == 2
    ckpt.close()


def test_partial_save_is_ignored(tmp_path, model, caplog):
    """A crash mid-save leaves Orbax's temporary folder: never taken for a checkpoint."""
    _save_steps(tmp_path, model, [1, 2])
    partial = tmp_path / "3.orbax-checkpoint-tmp-1700000000000000"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "_METADATA").write_text("{")   # cut off mid-write
    with caplog.at_level(logging.WARNING):
        ckpt = Checkpointer(tmp_path)
        step, _, meta = ckpt.latest(_like(model))
    assert step == 2 and meta == {"cursor": 2} and ckpt.all_steps() == [1, 2]
    assert not [r for r in caplog.records if "damaged" in r.getMessage()]
    ckpt.close()


def test_restore_into_sharded_like(tmp_path, model):
    """Saved from one device, restored onto data 2 x fsdp 2 x tensor 2 with the train-state shardings."""
    optimizer = update.make_optimizer(OPTIM)
    state = fresh_state(model)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(0, {"train": state}, {})
    ckpt.close()
    mesh = make_mesh((2, 2, 2))
    shardings = update.train_state_shardings(mesh, model.family.param_axes(CONFIG), optimizer, state.params)
    like = {"train": jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)}
    _, tree, _ = Checkpointer(tmp_path).latest(like)
    restored = tree["train"]
    jax.tree.map(lambda x, s: (x.sharding == s) or pytest.fail(f"{x.sharding} != {s}"), restored, shardings)
    assert tuple(restored.params["embed_vd"].sharding.spec) == ("tensor", "fsdp")
    assert_equal_trees(restored, state)


def test_a_damaged_checkpoint_leaves_no_abandoned_read_errors(tmp_path, monkeypatch, caplog):
    """Orbax abandons the shard reads still in flight when one fails (it closes its event loop without
    cancelling them); closed at garbage collection, each raised "Exception ignored in: <coroutine object
    _read_array_index_and_device_put>" with a TensorStore dump. Here one read of step 2 fails while five
    others of it are still waiting, as a truncated file does to a big sharded state."""
    import asyncio
    import gc
    import sys

    from orbax.checkpoint._src.serialization import serialization

    tree = {f"w{i}": jnp.arange(2000, dtype=jnp.float32) + i for i in range(6)}
    ckpt = Checkpointer(tmp_path, max_to_keep=5)
    ckpt.save(1, tree, {})
    ckpt.save(2, jax.tree.map(lambda x: x + 1, tree), {})
    ckpt.close()
    real_read, reads = serialization._read_shard, []

    async def one_read_fails(**kwargs):
        reads.append(kwargs)
        if len(reads) == 1:
            await asyncio.sleep(0.05)
            raise OSError("a truncated chunk")
        if len(reads) <= 6:
            await asyncio.sleep(30)   # still in flight when the first fails
        return await real_read(**kwargs)

    monkeypatch.setattr(serialization, "_read_shard", one_read_fails)
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with caplog.at_level(logging.WARNING):
        step, restored, _ = Checkpointer(tmp_path).latest(tree)
    gc.collect()
    assert step == 1 and all(np.array_equal(restored[k], tree[k]) for k in tree)
    assert len(reads) == 12 and sum("/2 is damaged" in r.getMessage() for r in caplog.records) == 1, caplog.text
    assert unraisable == [], [str(u.exc_value)[:200] for u in unraisable]
