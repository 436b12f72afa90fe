"""What the model benchmarks (bench_generate, bench_qwen35) share.

Common model-size arguments, best-of-N timing, a random transformers model
saved with `save_pretrained`, and transformers' greedy `generate` as the peer.
Imported by the scripts as `bench_common` (they run with `launch/` on the path).
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def add_model_arguments(parser: argparse.ArgumentParser, *, kv_heads: int, heads_help: str | None = None) -> None:
    """--hidden/--layers/--vocab/--heads/--kv_heads/--intermediate and --repeats/--threads/--seed."""
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--heads", type=int, default=8, help=heads_help)
    parser.add_argument("--kv_heads", type=int, default=kv_heads)
    parser.add_argument("--intermediate", type=int, default=1536, help="MLP width (3x hidden, as Qwen3-0.6B)")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per side; the best is kept")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--seed", type=int, default=0)


def best_of(fn, repeats: int):
    """(best wall seconds over `repeats` calls, the last call's result); the machine may be shared."""
    best, out = float("inf"), None
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def save_random_hf(model_class, config, path: str, seed: int):
    """A randomly initialised (HF's init) f32 `model_class(config)` saved to `path`; returns the torch model."""
    import torch

    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32).eval()
    model.save_pretrained(path)
    return model


def hf_greedy(hf_model, prompts):
    """run(n) -> new tokens [B][n] of transformers' greedy `generate` (KV cache, exactly n new tokens)."""
    import torch

    input_ids = torch.as_tensor(np.asarray(prompts, np.int64))
    mask = torch.ones_like(input_ids)

    def run(new_tokens: int) -> list[list[int]]:
        with torch.inference_mode():
            out = hf_model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
            )
        return out[:, input_ids.shape[1] :].tolist()

    return run
