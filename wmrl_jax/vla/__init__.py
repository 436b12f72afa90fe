"""The VLA track's policy in JAX (issue #30): action tokens, a small ViT, the VLA model on any text family.

    from wmrl_jax.vla import ActionTokenizer, model, vision
    cfg = model.Config(backbone=qwen2_config, vision=vision.VisionConfig(image_size=128))
    params = model.init(cfg, jax.random.key(0))
    actions = model.act(params, cfg, obs, rng, temperature=0.0)   # float32 [N, 7] in [-1, 1]

SFT on demonstrations: `wmrl_jax.vla.demos` (Episode files -> samples), `wmrl_jax.vla.sft` (the training loop,
the saved policy), `wmrl_jax.vla.evaluate` (the policy in `simulator.SimPool`, success per task); imported on
use, not here.
"""

from wmrl_jax.vla import model, vision
from wmrl_jax.vla.actions import ActionTokenizer

__all__ = ["ActionTokenizer", "model", "vision"]
