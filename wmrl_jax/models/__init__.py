"""Qwen-family models in JAX: pure-function families, HF checkpoint I/O, tokenizer, sharding.

    model = load_hf("path/to/qwen3", dtype="bfloat16", mesh=make_mesh((1, 2, 4)))
    logits = model.logits(tokens)          # float32[B, T, V]
    save_hf(model, "out/")                  # loadable by transformers
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from wmrl_jax.models.family import FAMILIES, HfTensor, Model, get_family
from wmrl_jax.models.hf_io import load_hf, save_hf
from wmrl_jax.models.sharding import make_mesh, shard_params, tree_shardings
from wmrl_jax.models.tokenizer import load_tokenizer


def init(config: Any, rng: jax.Array, dtype: Any = "float32", *, mesh: jax.sharding.Mesh | None = None) -> Model:
    """A randomly initialised `Model` of `config` (any family's Config), sharded over `mesh` if given."""
    family = family_of(config)
    dtype = jnp.dtype(dtype)

    def make(rng):
        return family.init_params(config, rng, dtype)

    if mesh is None:
        params = jax.jit(make)(rng)
    else:
        # Each device computes only its own shards: the model is never whole on one device.
        out = tree_shardings(mesh, family.param_axes(config), jax.eval_shape(make, rng))
        params = jax.jit(make, out_shardings=out)(rng)
    return Model(config=config, params=params, family=family, mesh=mesh)


def family_of(config: Any):
    """The family whose `Config` class `config` is (a family may define it in a helper module)."""
    for model_type in FAMILIES:
        family = get_family(model_type)
        if type(config) is family.Config:
            return family
    raise TypeError(f"config: {type(config).__name__} from {type(config).__module__} is not the Config of a "
                    f"registered family {sorted(set(FAMILIES.values()))}")


__all__ = [
    "FAMILIES",
    "HfTensor",
    "Model",
    "family_of",
    "get_family",
    "init",
    "load_hf",
    "load_tokenizer",
    "make_mesh",
    "save_hf",
    "shard_params",
]
