"""The VLA's image encoder: a small ViT of the project's own (patch embedding + pre-norm transformer layers).

No pretrained weights: it is trained with the policy (SFT on demonstrations).
One camera image -> one token per patch:

    x = uint8 [B, H, W, 3] / 127.5 - 1                     # pixels in [-1, 1]
    x = patches(x) [B, P, p·p·3] · patch_embed + b + pos_embed[P] + camera_embed[c]
    x = x + attn(LN(x)); x = x + mlp(LN(x))                # × layers, bidirectional, GELU MLP
    out = LN(x)                                            # [B, P, W]

Each camera is encoded separately with the same weights; the camera's
learned embedding tells the encoder which view it sees. Params (L = layers,
W width, N heads, H head dim, F MLP width, X = p·p·3, C cameras):
  patch_embed_xw [X, W], patch_bias_w [W], pos_embed_pw [P, W], camera_embed_cw [C, W],
  final_norm_scale_w / final_norm_bias_w [W],
  layers: attn_norm_scale_w / attn_norm_bias_w [L, W], q_proj_wnh / k_proj_wnh / v_proj_wnh [L, W, N, H],
  qkv_bias_snh [L, 3, N, H], o_proj_nhw [L, N, H, W], o_bias_w [L, W],
  mlp_norm_scale_w / mlp_norm_bias_w [L, W], mlp_in_wf [L, W, F], mlp_in_bias_f [L, F],
  mlp_out_fw [L, F, W], mlp_out_bias_w [L, W].
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """A ViT over square images of `image_size` pixels in patches of `patch_size`."""

    image_size: int = 128
    patch_size: int = 16
    width: int = 384
    num_layers: int = 4
    num_heads: int = 6
    mlp_size: int = 1536
    num_cameras: int = 2
    norm_eps: float = 1e-6
    initializer_range: float = 0.02

    def __post_init__(self):
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size={self.image_size} is not a multiple of patch_size={self.patch_size}")
        if self.width % self.num_heads:
            raise ValueError(f"width={self.width} is not a multiple of num_heads={self.num_heads}")
        if min(self.num_layers, self.num_cameras, self.mlp_size) < 1:
            raise ValueError(f"num_layers={self.num_layers}, num_cameras={self.num_cameras}, "
                             f"mlp_size={self.mlp_size}: expected >= 1 each")

    @property
    def num_patches(self) -> int:
        """P, tokens per camera image."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads


def _layer_shapes(c: VisionConfig) -> dict[str, tuple[int, ...]]:
    w, n, h, f = c.width, c.num_heads, c.head_dim, c.mlp_size
    return {
        "attn_norm_scale_w": (w,), "attn_norm_bias_w": (w,),
        "q_proj_wnh": (w, n, h), "k_proj_wnh": (w, n, h), "v_proj_wnh": (w, n, h), "qkv_bias_snh": (3, n, h),
        "o_proj_nhw": (n, h, w), "o_bias_w": (w,),
        "mlp_norm_scale_w": (w,), "mlp_norm_bias_w": (w,),
        "mlp_in_wf": (w, f), "mlp_in_bias_f": (f,), "mlp_out_fw": (f, w), "mlp_out_bias_w": (w,),
    }  # fmt: skip


def _fill(name: str):
    """How a leaf starts: norm scales 1, biases 0, everything else N(0, initializer_range)."""
    if "scale" in name:
        return jnp.ones
    if "bias" in name:
        return jnp.zeros
    return None


def init_params(config: VisionConfig, rng: jax.Array, dtype: Any = jnp.float32) -> dict:
    """Random init: matrices and embeddings N(0, initializer_range) (one draw, sliced), norms 1, biases 0."""
    c = config
    shapes = {
        "patch_embed_xw": (c.patch_size * c.patch_size * 3, c.width), "patch_bias_w": (c.width,),
        "pos_embed_pw": (c.num_patches, c.width), "camera_embed_cw": (c.num_cameras, c.width),
        "final_norm_scale_w": (c.width,), "final_norm_bias_w": (c.width,),
    }  # fmt: skip
    shapes.update({("layers", k): (c.num_layers,) + s for k, s in _layer_shapes(c).items()})
    drawn = [k for k in shapes if _fill(k[-1] if isinstance(k, tuple) else k) is None]
    sizes = [math.prod(shapes[k]) for k in drawn]
    flat = c.initializer_range * jax.random.normal(rng, (sum(sizes),), jnp.float32)
    params: dict = {"layers": {}}
    starts = dict(zip(drawn, np.cumsum([0] + sizes)))
    for key, shape in shapes.items():
        name = key[-1] if isinstance(key, tuple) else key
        fill = _fill(name)
        if fill is None:
            value = flat[starts[key] : starts[key] + math.prod(shape)].reshape(shape).astype(dtype)
        else:
            value = fill(shape, dtype)
        (params["layers"] if isinstance(key, tuple) else params)[name] = value
    return params


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis, computed in f32, returned in x.dtype."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps) * scale.astype(jnp.float32) + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def patches(images: jax.Array, patch_size: int) -> jax.Array:
    """[B, H, W, 3] -> [B, (H/p)·(W/p), p·p·3], patches in row-major order, each flattened (row, col, channel)."""
    b, height, width, ch = images.shape
    p = patch_size
    x = images.reshape(b, height // p, p, width // p, p, ch).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, (height // p) * (width // p), p * p * ch)


def check_images(config: VisionConfig, images: Any, name: str) -> None:
    """Clear errors for a camera array that is not uint8 [B, image_size, image_size, 3]."""
    s = config.image_size
    if getattr(images, "ndim", None) != 4 or tuple(images.shape[1:]) != (s, s, 3):
        raise ValueError(f"{name}: shape {tuple(getattr(images, 'shape', ()))}, expected uint8 [B, {s}, {s}, 3] "
                         f"(image_size={s}; resize frames before the model)")
    if images.dtype != jnp.uint8:
        raise ValueError(f"{name}: dtype {images.dtype}, expected uint8 pixels [B, {s}, {s}, 3]")


def encode(params: dict, config: VisionConfig, images: jax.Array, camera: int) -> jax.Array:
    """Patch tokens [B, P, W] (params' dtype) of uint8 images [B, image_size, image_size, 3] from camera `camera`."""
    c = config
    check_images(c, images, f"camera {camera}")
    dtype = params["patch_embed_xw"].dtype
    x = patches(images.astype(jnp.float32) / 127.5 - 1.0, c.patch_size).astype(dtype)
    x = jnp.einsum("bpx,xw->bpw", x, params["patch_embed_xw"]) + params["patch_bias_w"]
    x = x + params["pos_embed_pw"] + params["camera_embed_cw"][camera]
    scale = c.head_dim**-0.5

    def layer(x, lp):
        h = layer_norm(x, lp["attn_norm_scale_w"], lp["attn_norm_bias_w"], c.norm_eps)
        q, k, v = (jnp.einsum("bpw,wnh->bpnh", h, lp[f"{name}_proj_wnh"]) + lp["qkv_bias_snh"][i]
                   for i, name in enumerate("qkv"))
        scores = jnp.einsum("bpnh,bsnh->bnps", q, k, preferred_element_type=jnp.float32) * scale
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        attn = jnp.einsum("bnps,bsnh->bpnh", probs, v)
        x = x + jnp.einsum("bpnh,nhw->bpw", attn, lp["o_proj_nhw"]) + lp["o_bias_w"]
        h = layer_norm(x, lp["mlp_norm_scale_w"], lp["mlp_norm_bias_w"], c.norm_eps)
        h = jax.nn.gelu(jnp.einsum("bpw,wf->bpf", h, lp["mlp_in_wf"]) + lp["mlp_in_bias_f"])
        return x + jnp.einsum("bpf,fw->bpw", h, lp["mlp_out_fw"]) + lp["mlp_out_bias_w"], None

    x, _ = jax.lax.scan(layer, x, params["layers"])
    return layer_norm(x, params["final_norm_scale_w"], params["final_norm_bias_w"], c.norm_eps)
