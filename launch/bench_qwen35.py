r"""Qwen3.5 speed: prefill and greedy decode of our JAX family vs transformers (PyTorch), same weights.

    python launch/bench_qwen35.py            # hidden 512, 8 layers (3 linear + 1 full, x2), vocab 32k;
                                             # prefill batch 8 x 2048 tokens; decode batch 8, 128 + 128 tokens
    python launch/bench_qwen35.py --quick    # smaller shapes (about a minute), same code paths
    python launch/bench_qwen35.py --dtype=bfloat16   # on a GPU: both sides there, in bf16 (transformers'
                                             # CUDA path: its fla / causal-conv1d kernels where installed)

Builds a random `Qwen3_5ForCausalLM` with transformers, saves it, loads it with
`wmrl_jax.models.load_hf`, then measures in this run, each side `--repeats`
times keeping the best, the sides taking turns (the machine may be shared, and
its speed drifts: `bench_common.best_of_interleaved`):

* prefill: the prompt through the model with a fresh cache, logits of the last
  position (what a sampler's prefill does). Ours: one jitted `forward` +
  `unembed`; transformers: `model(..., use_cache=True, logits_to_keep=1)`,
  which runs `torch_chunk_gated_delta_rule` / `causal_conv1d_fn`.
* decode: new tokens/s of greedy decoding after the prompt, as
  ``B · (N − 1) / (t(N new tokens) − t(1 new token))`` so that the prefill
  cancels. Ours: `wmrl_jax.sampling.generate` (jitted prefill + while-loop
  decode, recurrent delta rule); transformers: `generate(do_sample=False)`
  (`torch_recurrent_gated_delta_rule`, `causal_conv1d_update`).

Prints compile times of ours, both sides' times and throughputs, the ratios
(ours / transformers), the floors (a prefill's and a decode step's weight
products alone, in XLA and in torch; for prefill against the time 3x would
allow), and how many greedy tokens agree (reported, not asserted: long greedy
runs on random weights can split after a near-tie).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

from bench_common import (
    add_model_arguments, best_of, best_of_interleaved, hf_greedy, matmul_chain_floor, place_torch, save_random_hf, torch_device,
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser, kv_heads=2, heads_help="full-attention query heads (head_dim 64)")
    parser.add_argument("--linear_key_heads", type=int, default=4, help="Gated DeltaNet q/k heads (dim 64)")
    parser.add_argument("--linear_value_heads", type=int, default=8, help="Gated DeltaNet value heads (dim 64)")
    parser.add_argument("--prefill_batch", type=int, default=8)
    parser.add_argument("--prefill_len", type=int, default=2048)
    parser.add_argument("--decode_batch", type=int, default=8)
    parser.add_argument("--prompt_len", type=int, default=128)
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--skip_prefill", action="store_true")
    parser.add_argument("--skip_decode", action="store_true")
    parser.add_argument(
        "--quick", action="store_true", help="hidden 256, 4 layers, vocab 8k; prefill 2 x 512; decode 4 x (32 + 32)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.vocab, args.heads, args.kv_heads = 256, 4, 8000, 4, 2
        args.linear_key_heads, args.linear_value_heads, args.intermediate = 2, 4, 768
        args.prefill_batch, args.prefill_len = 2, 512
        args.decode_batch, args.prompt_len, args.new_tokens, args.repeats = 4, 32, 32, 1
    return args


def build_checkpoint(args, path: str):
    """A random f32 `Qwen3_5ForCausalLM` (HF's init) saved to `path`; returns the torch model."""
    import transformers

    config = transformers.Qwen3_5TextConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=64,
        linear_num_key_heads=args.linear_key_heads,
        linear_num_value_heads=args.linear_value_heads,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        max_position_embeddings=max(args.prefill_len, args.prompt_len + args.new_tokens),
        tie_word_embeddings=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return save_random_hf(transformers.Qwen3_5ForCausalLM, config, path, args.seed)


def prefill_ours(model, tokens: np.ndarray):
    """(compile s, run) of a cached prefill; run() -> last-position logits."""
    import jax
    import jax.numpy as jnp

    from wmrl_jax.models.layers import positions_from_valid

    family, config = model.family, model.config

    def prefill(params, tokens):
        valid = jnp.ones(tokens.shape, bool)
        cache = family.init_cache(config, tokens.shape[0], tokens.shape[1], params["embed_vd"].dtype)
        hidden, cache = family.forward(params, config, tokens, positions_from_valid(valid), valid, cache)
        return family.unembed(params, config, hidden[:, -1:])[:, 0], cache

    tokens = jnp.asarray(tokens, jnp.int32)
    start = time.perf_counter()
    compiled = jax.jit(prefill).lower(model.params, tokens).compile()
    compile_s = time.perf_counter() - start
    run = lambda: np.asarray(jax.block_until_ready(compiled(model.params, tokens))[0])
    run()
    return compile_s, run


def prefill_transformers(hf_model, tokens: np.ndarray):
    """run() -> last-position logits of transformers' cached prefill (after a warm-up call)."""
    import torch

    input_ids = torch.as_tensor(tokens, dtype=torch.long, device=next(hf_model.parameters()).device)

    def run():
        with torch.inference_mode():
            return hf_model(input_ids=input_ids, use_cache=True, logits_to_keep=1).logits[:, -1].float().cpu().numpy()

    run()
    return run


def weight_matrices(model, *, unembed: bool) -> list:
    """Every layer's projection and MLP weights as [in, out] matrices in layer order (+ the unembedding)."""
    import jax.numpy as jnp

    from wmrl_jax.models.qwen35 import _PROJ_IN

    c, params = model.config, model.params

    def layer_weights(layer: dict) -> list:
        out = []
        for name, w in layer.items():
            if name in _PROJ_IN:
                n_in = _PROJ_IN[name]
                out.append(jnp.reshape(w, (int(np.prod(w.shape[:n_in])), -1)))
        return out

    weights = []
    for r in range(c.num_repeats):
        for j in range(len(c.pattern)):
            weights += layer_weights({name: w[r] for name, w in params["blocks"][str(j)].items()})
    for i in range(len(c.tail_types)):
        weights += layer_weights(params["tail"][str(i)])
    if unembed:
        weights.append(params["embed_vd"].T if c.tie_word_embeddings else params["lm_head_dv"])
    return weights


def prefill_floor(model, rows: int, device: str) -> tuple[float, float]:
    """(XLA, torch) best seconds of a prefill's weight products alone, ``rows`` = batch x length.

    ``bench_common.matmul_chain_floor`` over the layers (the last position's
    unembedding is left out: one row per sequence): the flops no delta rule,
    attention or fusion can remove.
    """
    return matmul_chain_floor(weight_matrices(model, unembed=False), rows, repeats=2, device=device)


def decode_floor(model, rows: int, device: str) -> tuple[float, float]:
    """(XLA, torch) best seconds of one decode step's weight products alone: layers and unembedding.

    Ours as the CPU decode multiplies: every product by ``layers.few_rows_matmul``
    where ``layers.few_rows_path`` (``qwen35.decode_layout``, ``layers.unembed``).
    """
    from wmrl_jax.models.layers import few_rows_path

    import jax

    weights = weight_matrices(model, unembed=True)
    few_rows = jax.default_backend() == "cpu" and few_rows_path(rows)   # the decode layout is CPU's default only
    return matmul_chain_floor(weights, rows, repeats=20, few_rows=[few_rows] * len(weights), device=device)


def decode_ours(model, prompts, new_tokens: int):
    """(compile s, run) of greedy `sampling.generate`; run(n) -> [B][n] new tokens.

    Compile = first call of each shape (1 and N new tokens) minus a compiled call.
    """
    from wmrl_jax import sampling

    def run(n: int) -> list:
        return sampling.generate(model, prompts, max_new_tokens=n, temperature=0.0).tokens

    compile_s = 0.0
    for n in (1, new_tokens):
        first, _ = best_of(lambda n=n: run(n), 1)
        again, _ = best_of(lambda n=n: run(n), 1)
        compile_s += first - again
    return compile_s, run


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    import jax

    from wmrl_jax.models import load_hf

    device = torch_device(args)
    with tempfile.TemporaryDirectory() as path:
        hf_model = place_torch(build_checkpoint(args, path), args)
        model = load_hf(path, dtype=args.dtype)
    c = model.config
    print(
        f"model: hidden {args.hidden}, {args.layers} layers ({c.num_repeats} x {'+'.join(t[:4] for t in c.pattern)}"
        f"{' + ' + str(len(c.tail_types)) if c.tail_types else ''}), vocab {args.vocab}, attention {args.heads}/"
        f"{args.kv_heads} heads, DeltaNet {args.linear_key_heads} qk / {args.linear_value_heads} v heads, mlp "
        f"{args.intermediate}; {args.dtype}, JAX on {jax.default_backend()}, torch on {device}, torch threads "
        f"{torch.get_num_threads()}",
        flush=True,
    )
    rng = np.random.default_rng(args.seed)
    result = {}
    if not args.skip_prefill:
        tokens = rng.integers(1, args.vocab, size=(args.prefill_batch, args.prefill_len))
        n = tokens.size
        compile_s, ours_run = prefill_ours(model, tokens)
        timed = best_of_interleaved({"ours": ours_run, "hf": prefill_transformers(hf_model, tokens)}, args.repeats)
        (ours_s, ours_logits), (hf_s, hf_logits) = timed["ours"], timed["hf"]
        print(f"prefill {args.prefill_batch} x {args.prefill_len}: wmrl_jax compile {compile_s:.1f} s, run {ours_s:.2f} s "
              f"-> {n / ours_s:,.0f} tokens/s", flush=True)
        err = float(np.abs(ours_logits - hf_logits).max())
        print(f"prefill transformers: run {hf_s:.2f} s -> {n / hf_s:,.0f} tokens/s; last-logit max |diff| {err:.1e}")
        print(f"prefill ratio (ours / transformers tokens/s): {hf_s / ours_s:.2f}x", flush=True)
        floor_s, torch_floor_s = prefill_floor(model, n, device)
        print(f"prefill floor: its dense weight products alone take {floor_s:.2f} s in XLA, {torch_floor_s:.2f} s in "
              f"torch; 3x transformers would need the whole prefill in {hf_s / 3:.2f} s", flush=True)
        result.update(prefill_ours_s=ours_s, prefill_hf_s=hf_s, prefill_ratio=hf_s / ours_s,
                      prefill_floor_s=floor_s, prefill_torch_floor_s=torch_floor_s)
    if not args.skip_decode:
        prompts = rng.integers(1, args.vocab, size=(args.decode_batch, args.prompt_len)).tolist()
        steps = args.decode_batch * (args.new_tokens - 1)
        compile_s, ours_run = decode_ours(model, prompts, args.new_tokens)
        hf_run = hf_greedy(hf_model, prompts)
        hf_run(2)  # warm-up
        timed = best_of_interleaved({
            "ours_1": lambda: ours_run(1), "ours_n": lambda: ours_run(args.new_tokens),
            "hf_1": lambda: hf_run(1), "hf_n": lambda: hf_run(args.new_tokens),
        }, args.repeats)
        (ours_1, _), (ours_n, ours_tokens) = timed["ours_1"], timed["ours_n"]
        (hf_1, _), (hf_n, hf_tokens) = timed["hf_1"], timed["hf_n"]
        ours_rate = steps / (ours_n - ours_1)
        print(f"decode {args.decode_batch} x ({args.prompt_len} + {args.new_tokens}): wmrl_jax compile ~{compile_s:.1f} s, "
              f"t(N) {ours_n:.2f} s, t(1) {ours_1:.2f} s -> {ours_rate:,.1f} new tokens/s", flush=True)
        hf_rate = steps / (hf_n - hf_1)
        agree = float(np.mean(np.asarray(ours_tokens) == np.asarray(hf_tokens)))
        print(f"decode transformers generate: t(N) {hf_n:.2f} s, t(1) {hf_1:.2f} s -> {hf_rate:,.1f} new tokens/s; "
              f"greedy tokens equal {agree:.1%}")
        print(f"decode ratio (ours / transformers tokens/s): {ours_rate / hf_rate:.2f}x", flush=True)
        floor_s, torch_floor_s = decode_floor(model, args.decode_batch, device)
        print(f"decode floor: a step's weight products alone take {floor_s * 1e3:.1f} ms in XLA, {torch_floor_s * 1e3:.1f} ms "
              f"in torch; ours spends {args.decode_batch / ours_rate * 1e3:.1f} ms a step, transformers "
              f"{args.decode_batch / hf_rate * 1e3:.1f} ms", flush=True)
        result.update(decode_floor_s=floor_s, decode_torch_floor_s=torch_floor_s)
        result.update(decode_ours_tps=ours_rate, decode_hf_tps=hf_rate, decode_ratio=ours_rate / hf_rate, agree=agree)
    return result


if __name__ == "__main__":
    main()
