r"""Multi-turn agent episodes with and without sampler-cache reuse, on the shipped micro-world model.

    python launch/bench_multiturn.py               # 2 tasks x 4 rollouts, 3 turns of <= 128 new tokens
    python launch/bench_multiturn.py --quick       # 1 task x 2 rollouts, 2 turns of <= 16 tokens (seconds)

Runs `agent.run_episodes` on embedded test tasks twice per round, with
`AgentConfig.reuse_cache` off (every turn re-prefills the whole conversation,
the path before reuse) and on (a later turn prefills only what was added
since the previous turn: the reply's last token, the observation and the next
assistant header), the two taking turns over `--repeats` rounds after one
warm-up (compile) run each, and keeps the best time of each. The observation
is a fixed synthetic feedback text (the world model's wording for a runtime
error), so only the agent's sampler is timed. Reports, measured in this run:
both times and their ratio, the prompt tokens each prefilled (real tokens,
and the padded positions the prefill computed), and whether both produced
the same episodes (tokens exactly; log-probs to 1e-4).
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

from bench_common import best_of_interleaved


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=2, help="embedded test tasks (groups)")
    parser.add_argument("--group", type=int, default=4, help="rollouts per task")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--new_tokens", type=int, default=128, help="max new tokens per turn")
    parser.add_argument("--repeats", type=int, default=2, help="timed rounds; the best time of each side is kept")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="1 task x 2 rollouts, 2 turns of <= 16 tokens, 1 round")
    args = parser.parse_args(argv)
    if args.quick:
        args.tasks, args.group, args.turns, args.new_tokens, args.repeats = 1, 2, 2, 16, 1
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    import jax

    import sandbox
    from sandbox import suite
    from wmrl_jax import agent, chat, micro_world, sampling, world_model

    lm = chat.load_chat_model(micro_world.shipped_path())
    tasks = [sandbox.load_task(p) for p in suite.list_tasks("test")[: args.tasks]]
    base = dataclasses.replace(micro_world.MicroWorldConfig().agent, max_turns=args.turns,
                               max_new_tokens=args.new_tokens)
    text = world_model.default_feedback("runtime_err", "KeyError line 12")

    def feedback(rows, solutions):
        return [text] * len(rows)

    counts = {}

    def counting(name):
        """generate, adding each call's prefilled tokens and positions to counts[name]."""
        def wrapped(*a, **kw):
            out = generate(*a, **kw)
            tokens, slots = counts.get(name, (0, 0))
            counts[name] = (tokens + out.prefill_tokens, slots + out.prefill_slots)
            return out
        return wrapped

    generate = sampling.generate
    runs = {}
    for name, reuse in (("reprefill", False), ("reuse", True)):
        config = dataclasses.replace(base, reuse_cache=reuse)

        def run(name=name, config=config):
            sampling.generate = counting(name)
            counts[name] = (0, 0)
            try:
                return agent.run_episodes(lm, tasks, args.group, config=config, feedback=feedback, seed=args.seed)
            finally:
                sampling.generate = generate

        runs[name] = run
    print(f"model: the shipped micro-world ({lm!r}); JAX on {jax.default_backend()}; {len(tasks)} tasks x "
          f"{args.group} rollouts, {args.turns} turns of <= {args.new_tokens} new tokens", flush=True)
    for run in runs.values():   # compile every turn's program once
        run()
    timed = best_of_interleaved(runs, args.repeats)
    (off_s, off), (on_s, on) = timed["reprefill"], timed["reuse"]
    same_tokens = all(np.array_equal(a.tokens, b.tokens) for a, b in zip(off, on))
    same_logprobs = same_tokens and all(np.allclose(a.logprobs, b.logprobs, atol=1e-4) for a, b in zip(off, on))
    agent_tokens = sum(int(e.loss_mask.sum()) for e in on)
    (off_tok, off_slots), (on_tok, on_slots) = counts["reprefill"], counts["reuse"]
    print(f"re-prefill every turn: {off_s:.2f} s; prefilled {off_tok} prompt tokens ({off_slots} padded positions)")
    print(f"continue the cache:    {on_s:.2f} s; prefilled {on_tok} prompt tokens ({on_slots} padded positions)")
    print(f"ratio (re-prefill / reuse time): {off_s / on_s:.2f}x; prefill tokens {off_tok / on_tok:.2f}x fewer; "
          f"{agent_tokens} agent tokens sampled; same episodes: tokens {same_tokens}, log-probs {same_logprobs}")
    return {"reprefill_s": off_s, "reuse_s": on_s, "ratio": off_s / on_s, "reprefill_tokens": off_tok,
            "reuse_tokens": on_tok, "reprefill_slots": off_slots, "reuse_slots": on_slots,
            "same_tokens": same_tokens, "same_logprobs": same_logprobs}


if __name__ == "__main__":
    main()
