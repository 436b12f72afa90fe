"""The embedded default's GRPO update, timed: rows written out whole (the peer) against shared prompts.

    python launch/bench_update.py                  # tiny_cpu's batch: 4 train tasks x 4 sampled rollouts
    python launch/bench_update.py --repeats=2      # quicker, noisier
    python launch/bench_update.py --quick          # a tiny random model: runs, not timed

A GRPO group's rollouts share their prompt (~450 of ~830 tokens on the
embedded suite). The peer is the update as the loop ran it before
`optim.share_prompt` ("never" keeps it): every row left-padded whole to the run's fixed width
(`run.batch_width`, the longest possible episode in 256s), so each prompt runs
through the backbone once per rollout, in the policy's forward, its
recomputation under layer remat, its backward and the reference's forward.
Ours: each group's prompt once, the rollouts' continuations from its cache
(`logprobs.prefix_logprobs`), widths in 32s (`run.shared_prompt_widths`);
also without layer remat (`optim.remat="none"`, the memory is no concern at
this size).

All sides update the same micro-world weights on the same sampled batch: the
first update's loss is printed for each (equal up to float rounding). The
first call compiles and is timed apart; then the best of --repeats updates.
Beside the times: the matmul FLOPs of each side's update (policy forward +
backward + recomputation, reference forward) and what they take at this
CPU's measured float32 matmul rate (a [2048, 256] x [256, 1024] product,
best of 20) -- the floor the update cannot beat.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import bench_common  # noqa: F401  (quiets absl/JAX INFO logs)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def matmul_gflops(repeats: int = 20) -> float:
    """This machine's float32 matmul rate in GFLOP/s: best of `repeats` [2048, 256] x [256, 1024] products."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (2048, 256), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (256, 1024), jnp.float32)
    f = jax.jit(jnp.matmul)
    f(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * 2048 * 256 * 1024 / best / 1e9


def update_flops(n_matmul: int, per_attn: float, batch, remat: bool) -> float:
    """Matmul FLOPs of one update on `batch`: (3 or 4) policy forwards + the reference's (padding included).

    A forward of a causal row of T tokens after C cached ones: 2·N·T + per_attn·(T² + 2·C·T) / 2 ... written
    as `train.plan.analytic_flops` counts it (per_attn = 2·heads·head_dim·full layers, times T² causal).
    """
    b, t = batch.tokens.shape

    def forward(tokens, context, rows):
        return rows * (2.0 * n_matmul * tokens + per_attn * (tokens**2 + 2 * context * tokens))

    if batch.prompt_tokens is None:
        one = forward(t, 0, b)
    else:
        g, p = batch.prompt_tokens.shape
        one = forward(p, 0, g) + forward(t, p, b)
    return (4 if remat else 3) * one + one


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=4, help="timed updates a side; the best is kept")
    parser.add_argument("--quick", action="store_true", help="a tiny random model and short rows (a smoke run)")
    parser.add_argument("--out", default="", help="write the figures as JSON here (a folder)")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from configs import tiny_cpu
    from sandbox import suite
    import sandbox
    from wmrl_jax import agent, chat, micro_world
    from wmrl_jax.train import config as train_config
    from wmrl_jax.train import update
    from wmrl_jax.train.loop import make_batch
    from wmrl_jax.train.run import batch_width, shared_prompt_widths

    config = tiny_cpu.get_config()
    groups, k = config.rollout.groups_per_step, config.rollout.group_size
    acfg = train_config.agent_config(config)
    train_tasks = [sandbox.load_task(p) for p in suite.list_tasks("train")]
    if args.quick:
        from wmrl_jax.models import init

        model_config = micro_world.MicroWorldConfig(num_layers=2, hidden_size=32, intermediate_size=64, num_heads=2,
                                                    num_kv_heads=1, head_dim=16).model_config(96, 1, 0)
        model = init(model_config, jax.random.key(0))
        family, params = model.family, model.params
        rng = np.random.default_rng(0)
        episodes = []
        for g in range(groups):
            prompt = rng.integers(3, 96, size=40).astype(np.int32)
            for _ in range(k):
                reply = rng.integers(3, 96, size=rng.integers(10, 30)).astype(np.int32)
                episodes.append(agent.Episode(
                    task_index=g, tokens=np.r_[prompt, reply], loss_mask=np.r_[np.zeros(40, bool), np.ones(len(reply), bool)],
                    logprobs=np.zeros(40 + len(reply), np.float32), prompt_len=40, replies=[""], solution=None,
                    observations=[], truncated=[False]))
        prompt_tokens, config.agent.max_new_tokens = 40, 32
    else:
        lm = chat.load_chat_model(micro_world.shipped_path())
        family, model_config, params = lm.model.family, lm.model.config, lm.model.params
        t0 = time.perf_counter()
        episodes = agent.run_episodes(lm, train_tasks[:groups], k, config=acfg, seed=0)
        print(f"sampled {len(episodes)} rollouts of {groups} train tasks in {time.perf_counter() - t0:.1f} s")
        prompt_tokens = max(len(lm.prompt_ids(agent.initial_messages(t, acfg))) for t in train_tasks)
    lengths = [len(e.tokens) for e in episodes]
    prompts = [e.prompt_len for e in episodes]
    print(f"rows: {min(lengths)}-{max(lengths)} tokens (mean {np.mean(lengths):.0f}), prompts {min(prompts)}-"
          f"{max(prompts)} (mean {np.mean(prompts):.0f}); longest train prompt {prompt_tokens}")

    rng = np.random.default_rng(1)
    advantages = rng.normal(size=len(episodes)).astype(np.float32)
    weights = np.ones(len(episodes), np.float32)
    prompt_width, width = shared_prompt_widths(config, prompt_tokens)
    batches = {
        "whole": make_batch(episodes, advantages, weights, width=batch_width(config, prompt_tokens), pad_id=0),
        "shared": make_batch(episodes, advantages, weights, width=width, pad_id=0, prompt_width=prompt_width,
                             group_size=k),
    }
    sides = [("peer: rows whole, remat full", "whole", "full"), ("shared prompts, remat full", "shared", "full"),
             ("shared prompts, no remat", "shared", None)]

    c = model_config
    n_matmul = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params) if x.ndim >= 2)
    full_layers = sum(t == "full_attention" for t in c.layer_types)
    per_attn = 2.0 * c.num_heads * c.head_dim * full_layers
    rate = matmul_gflops()
    optimizer = update.make_optimizer(config.optim)
    rows = {}
    for name, which, remat in sides:
        batch = batches[which]
        step = update.make_train_step(family, model_config, optimizer, kl_coef=config.optim.kl_coef,
                                      entropy_coef=config.optim.entropy_coef, clip_eps=config.optim.clip_eps,
                                      remat=remat, temperature=acfg.temperature)
        state = update.init_train_state(jax.tree.map(jnp.copy, params), optimizer)
        t0 = time.perf_counter()
        state, metrics = step(state, params, batch)
        loss = float(metrics["loss"])
        compile_s = time.perf_counter() - t0
        times = []
        for _ in range(1 if args.quick else args.repeats):
            t0 = time.perf_counter()
            state, metrics = step(state, params, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - t0)
        flops = update_flops(n_matmul, per_attn, batch, remat is not None)
        slots = batch.tokens.size + (0 if batch.prompt_tokens is None else batch.prompt_tokens.size)
        rows[name] = dict(seconds=min(times), compile_s=compile_s, first_loss=loss, token_slots=int(slots),
                          gflop=flops / 1e9, floor_s=flops / (rate * 1e9))
        print(f"  {name}: {min(times):.2f} s (first call {compile_s:.1f} s), loss {loss:.6f}", flush=True)

    peer = rows[sides[0][0]]["seconds"]
    print(f"\nthis CPU's float32 matmul rate: {rate:.1f} GFLOP/s ({os.cpu_count()} cores)")
    print(f"{'update':<32} {'token slots':>11} {'GFLOP':>7} {'floor s':>8} {'s':>7} {'of floor':>8} {'speed-up':>9} "
          f"{'first loss':>11}")
    for name, r in rows.items():
        print(f"{name:<32} {r['token_slots']:>11,} {r['gflop']:>7.1f} {r['floor_s']:>8.2f} {r['seconds']:>7.2f} "
              f"{r['seconds'] / r['floor_s']:>7.1f}x {peer / r['seconds']:>8.2f}x {r['first_loss']:>11.6f}")
    out = {"matmul_gflops": rate, "sides": rows, "rows": len(episodes), "groups": groups}
    if args.out:
        path = pathlib.Path(args.out)
        path.mkdir(parents=True, exist_ok=True)
        (path / "bench_update.json").write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {path / 'bench_update.json'}")
    return out


if __name__ == "__main__":
    main()
