r"""Greedy decoding speed: our jitted sampler vs transformers `generate` (PyTorch), same weights.

    python launch/bench_generate.py            # hidden 512, 8 layers, vocab 32k, batch 32, 128 + 256 tokens
    python launch/bench_generate.py --quick    # a smaller run (seconds), same code paths
    python launch/bench_generate.py --dtype=bfloat16   # on a GPU: both sides there, in bf16

Builds a random Qwen3 with transformers, saves it with `save_pretrained`, loads
it with `wmrl_jax.models.load_hf`, and decodes the same left-padded prompts
greedily with both (every row runs the full `--new_tokens`: no EOS). Reports,
measured in this run: compile time of our sampler (first call minus a compiled
call: one program holds prefill and the while-loop decode), wall time of a compiled call, transformers'
wall time (after a short warm-up call), new tokens/s of each, the ratio, and
how many greedy tokens agree (the same dtype on both sides; long greedy runs on random
weights can diverge after a near-tie, so this is reported, not asserted), and
the floor of a decode step: its weight matmuls alone, in XLA and in torch.
Each side is timed `--repeats` times, the sides taking turns, and the best
time is kept (the machine may be shared, and its speed drifts).
"""

from __future__ import annotations

import argparse
import tempfile

import numpy as np

from bench_common import (
    add_model_arguments, best_of, best_of_interleaved, hf_greedy, matmul_chain_floor, place_torch, save_random_hf, torch_device,
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser, kv_heads=4)
    parser.add_argument("--head_dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt_len", type=int, default=128)
    parser.add_argument("--new_tokens", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="hidden 256, 4 layers, vocab 8k, batch 8, 32 + 32 tokens")
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.vocab, args.heads, args.kv_heads = 256, 4, 8000, 4, 2
        args.head_dim, args.intermediate, args.batch, args.prompt_len, args.new_tokens = 64, 768, 8, 32, 32
        args.repeats = 1
    return args


def build_checkpoint(args, path: str):
    """A random f32 Qwen3ForCausalLM (weights ~ N(0, 0.02), as HF inits) saved to `path`; returns the torch model."""
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=args.prompt_len + args.new_tokens,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    return save_random_hf(transformers.Qwen3ForCausalLM, config, path, args.seed)


def make_prompts(args) -> list[list[int]]:
    rng = np.random.default_rng(args.seed)
    return rng.integers(1, args.vocab, size=(args.batch, args.prompt_len)).tolist()


def time_both(model, hf_model, prompts, args) -> tuple[float, float, list, float, list]:
    """(compile s, ours best s, ours tokens, transformers best s, its tokens), the sides taking turns.

    Compile = our first call (trace + compile + run) minus a compiled call;
    transformers' `generate` gets a 2-token warm-up first.
    """
    from wmrl_jax import sampling

    def ours():
        return sampling.generate(model, prompts, max_new_tokens=args.new_tokens, temperature=0.0).tokens

    first, _ = best_of(ours, 1)
    again, _ = best_of(ours, 1)
    hf_run = hf_greedy(hf_model, prompts)
    hf_run(2)
    timed = best_of_interleaved({"ours": ours, "hf": lambda: hf_run(args.new_tokens)}, args.repeats)
    return first - again, *timed["ours"], *timed["hf"]


def matmul_floor(model, args) -> tuple[float, float]:
    """(ours, torch) best seconds of a decode step's weight matmuls alone: its floor on this machine.

    One [batch, D] activation through every layer's q|k|v, o, gate|up and
    down weights and the unembedding (the same arrays the sampler reads,
    multiplied as it does at one token on CPU): ``bench_common.matmul_chain_floor``.
    """
    import jax

    # The per-layer weights exactly as the sampler decodes with them (fused q|k|v and gate|up).
    params, _ = jax.jit(lambda p: model.family.decode_layout(model.config, p, None))(model.params)
    from wmrl_jax.models.layers import OutIn, few_rows_path

    weights = []
    for lp in params["layers"]:
        weights += [lp["qkv_proj_dx"], lp["o_proj_xd"], lp["gate_up_proj_dx"], lp["down_proj_fd"]]
    weights.append(params["lm_head_dv"])  # the decode layout's head: OutIn [V, D], tied or not
    # [in, out] arrays for the chain; the OutIn ones (all) multiply as the sampler does (`layers.project`).
    # The decode layout is the sampler's default on CPU only; elsewhere its products are plain dots.
    on_cpu = jax.default_backend() == "cpu"
    few_rows = [on_cpu and isinstance(w, OutIn) and few_rows_path(args.batch) for w in weights]
    weights = [w.weight.T if isinstance(w, OutIn) else w for w in weights]
    return matmul_chain_floor(weights, args.batch, repeats=20, few_rows=few_rows, device=torch_device(args))


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    import jax

    from wmrl_jax.models import load_hf

    prompts = make_prompts(args)
    new = args.batch * args.new_tokens
    with tempfile.TemporaryDirectory() as path:
        hf_model = place_torch(build_checkpoint(args, path), args)
        model = load_hf(path, dtype=args.dtype)
    print(
        f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, heads {args.heads}/{args.kv_heads}, "
        f"head_dim {args.head_dim}, mlp {args.intermediate}; batch {args.batch}, prompt {args.prompt_len}, "
        f"new {args.new_tokens} (greedy, {args.dtype}; JAX on {jax.default_backend()}, torch on {torch_device(args)}, "
        f"torch threads {torch.get_num_threads()})",
        flush=True,
    )
    compile_s, ours_s, ours_tokens, hf_s, hf_tokens = time_both(model, hf_model, prompts, args)
    print(f"wmrl_jax sampler: compile {compile_s:.1f} s, run {ours_s:.2f} s -> {new / ours_s:.1f} new tokens/s", flush=True)
    print(f"transformers generate: run {hf_s:.2f} s -> {new / hf_s:.1f} new tokens/s", flush=True)
    agree = np.mean(np.asarray(ours_tokens) == np.asarray(hf_tokens))
    ratio = hf_s / ours_s
    print(f"ratio (ours / transformers tokens/s): {ratio:.2f}x; greedy tokens equal: {agree:.1%}")
    floor_s, torch_floor_s = matmul_floor(model, args)
    steps = args.new_tokens - 1
    print(
        f"floor: a decode step's weight matmuls alone take {floor_s * 1e3:.1f} ms in XLA, "
        f"{torch_floor_s * 1e3:.1f} ms in torch; ours spends {(ours_s / max(steps, 1)) * 1e3:.1f} ms a token "
        f"(prefill included), transformers {(hf_s / max(steps, 1)) * 1e3:.1f} ms"
    )
    return {
        "compile_s": compile_s,
        "ours_s": ours_s,
        "hf_s": hf_s,
        "ratio": ratio,
        "agree": agree,
        "floor_step_s": floor_s,
        "torch_floor_step_s": torch_floor_s,
    }


if __name__ == "__main__":
    main()
