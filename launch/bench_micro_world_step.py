"""The micro-world build's training steps, timed against the way they were padded and projected before.

    python launch/bench_micro_world_step.py              # micro-world size, its real corpus batches, 2 cores
    python launch/bench_micro_world_step.py --steps=2    # quicker, noisier
    python launch/bench_micro_world_step.py --quick      # a tiny model on 64 episodes: runs, not timed

Two steps dominate a build with the outcome stream and the world-model stage
(`MicroWorldConfig.outcome_batch_size`, `outcome_stage_*`):

* the mixed step with 8 outcome episodes beside 4 agent episodes and 8 rule
  examples -- peer: the outcome batch padded to the longest outcome episode
  of all and the vocabulary projection over every position; ours: padded to
  a multiple of 64 past the batch's longest row and projected on the
  answers' tail only (`answer_tail`);
* the stage's outcome update on 16 episodes -- peer: padded to a multiple of
  256 and projected everywhere; ours as above.

Each side runs the same seeded batches (same rows, so the same loss up to
float rounding, printed) from the same random micro-world weights; the
first step of each width compiles and is left out; the best of --repeats
passes over --steps batches is kept. Prints seconds per step and the ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import bench_common  # noqa: F401  (quiets absl/JAX INFO logs)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> dict:
    """Prints the table; returns {step name: (peer s, our s, peer mean loss, our mean loss)}."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="timed batches a pass")
    parser.add_argument("--repeats", type=int, default=2, help="passes a side; the best is kept")
    parser.add_argument("--quick", action="store_true", help="a tiny model on 64 outcome episodes, 1 step")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 1, 1

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from wmrl_jax import micro_world as mw
    from wmrl_jax.models import load_tokenizer, qwen35

    config = mw.MicroWorldConfig()
    if args.quick:
        config = dataclasses.replace(config, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1,
                                     head_dim=16)
    config = dataclasses.replace(config, world_model=dataclasses.replace(config.world_model, listing="comment",
                                                                         inventory="columns"))
    tokenizer = load_tokenizer(mw.shipped_path())   # any tokenizer of the suite's text times the same
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model_config = config.model_config(len(tokenizer), tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_id)
    params = jax.jit(lambda key: qwen35.init_params(model_config, key, jnp.float32))(jax.random.key(0))
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-4))
    opt_state = optimizer.init(params)

    eps = mw.outcome_examples(config)
    outcomes = mw.outcome_marks(mw.encode_examples(tokenizer, eps), [kind for *_, kind in eps])
    if args.quick:
        outcomes = outcomes[:64]
    tail = mw.answer_tail(outcomes)
    encoded = mw.encode_examples(tokenizer, mw.training_examples(config))
    width = -(-max(len(ids) for ids, _ in encoded) // 32) * 32
    rules = mw.encode_examples(tokenizer, mw.rule_examples(8, 1))
    rule_batch = mw._pad_rows(rules, -(-max(len(ids) for ids, _ in rules) // 32) * 32, pad_id)
    episode_batch = next(mw.batches(encoded, batch_size=4, steps=1, width=width, pad_id=pad_id, seed=0))
    count = args.steps + 1
    longest = -(-max(len(ids) for ids, _ in outcomes) // 32) * 32
    lengths = np.array([len(ids) for ids, _ in outcomes])
    print(f"micro-world {sum(x.size for x in jax.tree.leaves(params)) / 1e6:.2f}M parameters, "
          f"{len(outcomes)} outcome episodes of {lengths.min()}-{lengths.max()} tokens (mean {lengths.mean():.0f}), "
          f"answers in the last {tail} positions; {jax.device_count()} CPU device(s), {os.cpu_count()} cores")

    def timed(step, batches):
        best, losses = float("inf"), None
        batches = list(batches)
        step(params, opt_state, *batches[0])   # compile the first width (others compile in the warm-up pass)
        for b in batches[1:]:
            jax.block_until_ready(step(params, opt_state, *b))
        for _ in range(args.repeats):
            start = time.perf_counter()
            out = [step(params, opt_state, *b)[2] for b in batches[1:]]
            jax.block_until_ready(out)
            best = min(best, (time.perf_counter() - start) / args.steps)
            losses = out
        return best, losses, np.mean([b[0].shape[1] for b in batches[1:]])

    rows = []
    # The mixed step with an outcome batch of 8.
    peer_step = mw.make_train_step(model_config, optimizer, 1.0, 1.0, 0.0, None)
    our_step = mw.make_train_step(model_config, optimizer, 1.0, 1.0, 0.0, tail)
    peer = timed(lambda p, o, *b: peer_step(p, o, episode_batch, rule_batch, b),
                 mw.batches(outcomes, batch_size=8, steps=count, width=longest, pad_id=pad_id, seed=2))
    ours = timed(lambda p, o, *b: our_step(p, o, episode_batch, rule_batch, b),
                 mw.stage_batches(outcomes, batch_size=8, steps=count, pad_id=pad_id, seed=2, multiple=64))
    rows.append(("mixed step (4 episodes + 8 rules + 8 outcome)", peer, ours, lambda l: float(l[-1])))
    # The stage's outcome update on 16 episodes.
    peer_step = mw.make_outcome_step(model_config, optimizer, skip=2, tail=None)
    our_step = mw.make_outcome_step(model_config, optimizer, skip=2, tail=tail)
    peer = timed(peer_step, mw.stage_batches(outcomes, batch_size=16, steps=count, pad_id=pad_id, seed=3,
                                             multiple=256))
    ours = timed(our_step, mw.stage_batches(outcomes, batch_size=16, steps=count, pad_id=pad_id, seed=3, multiple=64))
    rows.append(("stage outcome update (16 outcome)", peer, ours, float))

    print(f"{'step':<48} {'peer s':>8} {'ours s':>8} {'speed-up':>9} {'outcome width peer/ours':>24} "
          f"{'outcome loss peer/ours (same rows)':>36}")
    results = {}
    for name, (peer_s, peer_l, peer_w), (our_s, our_l, our_w), loss in rows:
        peer_loss, our_loss = (float(np.mean([loss(x) for x in ls])) for ls in (peer_l, our_l))
        print(f"{name:<48} {peer_s:8.2f} {our_s:8.2f} {peer_s / our_s:8.2f}x {peer_w:11.0f} / {our_w:<10.0f} "
              f"{peer_loss:17.5f} / {our_loss:.5f}")
        results[name] = (peer_s, our_s, peer_loss, our_loss)
    return results


if __name__ == "__main__":
    main()
