"""Parameter counts of the Qwen3.5 presets vs the published model sizes.

    python launch/param_count.py        # < 10 s on CPU, allocates nothing (shapes only)

Counts the text model our `qwen35.init_params` builds for each preset
(`wmrl_jax.models.qwen35.PRESETS`, values from the released config.json
files) by component, next to the published size. Published sizes: the model
cards' "Number of Parameters" (4B, 9B: the language model; the checkpoints
also hold a ~0.4B vision tower and an MTP head, which the text model does not
load) and the 8.95B that llama.cpp reports for the Qwen3.5-9B text weights.
"""

from __future__ import annotations

import argparse
import math

import bench_common  # noqa: F401  (importing it quiets absl/JAX INFO logs; before jax)
import jax
import jax.numpy as jnp

from wmrl_jax.models import qwen35

# name -> (published size in parameters, where it is published)
PUBLISHED = {
    "qwen3.5-4b": (4e9, "huggingface.co/Qwen/Qwen3.5-4B model card: 4B"),
    "qwen3.5-9b": (8.95e9, "huggingface.co/Qwen/Qwen3.5-9B model card: 9B; GGUF text weights: 8.95B"),
}


def breakdown(config: qwen35.Config) -> dict[str, int]:
    """Parameters per component (embedding, LM head, linear-attention / full-attention / MLP / norm weights)."""
    shapes = jax.eval_shape(lambda: qwen35.init_params(config, jax.random.key(0), jnp.bfloat16))
    counts = {"embedding": math.prod(shapes["embed_vd"].shape), "lm_head": 0, "final_norm": config.hidden_size}
    if "lm_head_dv" in shapes:
        counts["lm_head"] = math.prod(shapes["lm_head_dv"].shape)
    mixers = {"linear attention": 0, "full attention": 0, "mlp": 0, "layer norms": 0}
    for part in ("blocks", "tail"):
        for layer in shapes[part].values():
            kind = "full attention" if "q_gate_proj_dnxh" in layer else "linear attention"
            for name, leaf in layer.items():
                n = math.prod(leaf.shape)
                if name in ("attn_norm_d", "mlp_norm_d"):
                    mixers["layer norms"] += n
                elif name.endswith("_df") or name.endswith("_fd"):
                    mixers["mlp"] += n
                else:
                    mixers[kind] += n
    counts.update(mixers)
    return counts


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(qwen35.PRESETS), action="append", help="default: all")
    args = parser.parse_args(argv)
    for name in args.preset or sorted(qwen35.PRESETS):
        config = qwen35.PRESETS[name]
        counts = breakdown(config)
        total = qwen35.num_params(config)
        assert total == sum(counts.values()), (total, counts)
        published, source = PUBLISHED[name]
        print(
            f"{name}: {total:,} parameters ({total / 1e9:.3f}B; tied head: {config.tie_word_embeddings}; "
            f"{config.num_layers} layers = {config.num_repeats} x {'+'.join(t.split('_')[0] for t in config.pattern)})"
        )
        for part, n in counts.items():
            print(f"  {part:17s} {n:>15,}")
        print(f"  published         {published / 1e9:.2f}B ({source}); ours / published = {total / published:.3f}")


if __name__ == "__main__":
    main()
