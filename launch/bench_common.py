"""What the launch scripts share.

Importing this module quiets absl/JAX INFO logging (`quiet_logs`), so every
script that imports it prints only its results, warnings and errors. For the
model benchmarks (bench_generate, bench_qwen35): common model-size arguments,
best-of-N timing, a random transformers model saved with `save_pretrained`,
transformers' greedy `generate` as the peer, and the matmul floor: a model's
weight products alone, in XLA and in torch. Imported by the scripts as
`bench_common` (they run with `launch/` on the path).
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import numpy as np


def quiet_logs() -> None:
    """Hide absl/JAX INFO lines; warnings and errors still print.

    absl's `app.run` puts the root logger at INFO, so JAX's backend probing
    prints `I... xla_bridge.py] Unable to initialize backend 'tpu'` on every
    run; an explicit WARNING level on JAX's module loggers survives that. It
    is set on `jax._src`, not `jax`: JAX takes the `jax` logger's level at
    import as its `jax_logging_level` and then adds a second handler, which
    prints every warning twice under absl. XLA's C++ logging reads
    TF_CPP_MIN_LOG_LEVEL when JAX loads its backend, so this must run before
    the first JAX computation (importing this module does). A level the user
    set (TF_CPP_MIN_LOG_LEVEL, JAX_LOGGING_LEVEL) wins.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")   # 1: C++ warnings and errors only
    if not os.environ.get("JAX_LOGGING_LEVEL"):
        logging.getLogger("jax._src").setLevel(logging.WARNING)


quiet_logs()


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
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="params and activations of both sides (bfloat16 on accelerators)")
    parser.add_argument("--torch_device", default="auto",
                        help="transformers' device: auto = cuda when JAX runs on a GPU and torch sees one, else cpu")


def torch_device(args) -> str:
    """The peer's device: `--torch_device`, or on `auto` the accelerator JAX uses when torch sees it too."""
    import jax
    import torch

    if args.torch_device != "auto":
        return args.torch_device
    return "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"


def place_torch(hf_model, args):
    """`hf_model` on `torch_device(args)` in `--dtype` (the same arithmetic as our side)."""
    import torch

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    return hf_model.to(device=torch_device(args), dtype=dtype)


def torch_sync(device) -> None:
    """Waits for queued accelerator work, so a wall-clock timer sees it (a no-op on CPU)."""
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def best_of(fn, repeats: int):
    """(best wall seconds over `repeats` calls, the last call's result); the machine may be shared."""
    best, out = float("inf"), None
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def best_of_interleaved(fns: dict, repeats: int) -> dict:
    """{name: (best wall seconds, last result)} of each fn run ``repeats`` times, the fns taking turns.

    One round runs every fn once; a machine whose speed drifts over minutes
    (a shared or throttled one) then weighs on every side alike, where timing
    one side's repeats and then the other's would fold the drift into the ratio.
    """
    best = {name: (float("inf"), None) for name in fns}
    for _ in range(max(1, repeats)):
        for name, fn in fns.items():
            start = time.perf_counter()
            out = fn()
            best[name] = (min(best[name][0], time.perf_counter() - start), out)
    return best


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

    device = next(hf_model.parameters()).device
    input_ids = torch.as_tensor(np.asarray(prompts, np.int64), device=device)
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


def matmul_chain_floor(weights, rows: int, repeats: int = 5, few_rows=None, device: str = "cpu") -> tuple[float, float]:
    """(XLA, torch) best seconds of ``rows`` activations through ``weights`` ([in, out] arrays), in order.

    Only the products run: no norms, attention, cache or sampling. Each one
    waits for the previous, as a forward pass's layers do: its smaller
    operand takes a zero derived from the previous output's max (no
    activations are copied between them; a sum could be merged into a
    multiply-and-reduce product's own reduction). What a forward pass over those
    weights at that many rows cannot beat without changing the arithmetic
    (precision, batch): its floor on this machine.

    Each side multiplies as its model code does: ours ``jnp.dot`` on the
    [in, out] arrays, or ``layers.few_rows_matmul`` on them transposed where
    ``few_rows[i]`` (a CPU decode step); torch ``F.linear`` on [out, in]
    weights, as ``nn.Linear``. Both sides in the weights' dtype; torch on
    ``device`` (synchronised before the clock stops).
    """
    import jax
    import jax.numpy as jnp
    import torch

    from wmrl_jax.models.layers import few_rows_matmul

    few_rows = [False] * len(weights) if few_rows is None else list(few_rows)
    dtype = jnp.dtype(weights[0].dtype)
    inputs = {n: np.full((rows, n), 0.01, np.float32) for n in sorted({w.shape[0] for w in weights})}
    jw = [jnp.transpose(w) if t else w for w, t in zip(weights, few_rows)]

    def product(x, w, transposed):
        return few_rows_matmul(x, w) if transposed else jnp.dot(x, w)

    @jax.jit
    def chain(inputs, weights):
        zero = jnp.zeros((), dtype)
        for w, t in zip(weights, few_rows):
            x = inputs[w.shape[1] if t else w.shape[0]]
            x, w = (x + zero, w) if x.size <= w.size else (x, w + zero)
            zero = 0.0 * product(x, w, t).max()
        return zero

    jx = {n: jnp.asarray(x, dtype) for n, x in inputs.items()}
    jax.block_until_ready(chain(jx, jw))
    ours, _ = best_of(lambda: jax.block_until_ready(chain(jx, jw)), repeats)
    tdtype = {jnp.dtype(jnp.float32): torch.float32, jnp.dtype(jnp.bfloat16): torch.bfloat16}[dtype]
    to_torch = lambda a: torch.from_numpy(np.ascontiguousarray(np.asarray(a, np.float32))).to(device, tdtype)
    tw = [to_torch(np.asarray(w, np.float32).T) for w in weights]
    tx = {n: to_torch(x) for n, x in inputs.items()}

    def torch_chain():
        with torch.inference_mode():
            zero = torch.zeros((), device=device, dtype=tdtype)
            for w in tw:
                x = tx[w.shape[1]]
                x, w = (x + zero, w) if x.numel() <= w.numel() else (x, w + zero)
                zero = 0.0 * torch.nn.functional.linear(x, w).max()
        torch_sync(device)
        return zero

    torch_chain()
    theirs, _ = best_of(torch_chain, repeats)
    return ours, theirs


def _config_fields(config, prefix: str = "") -> list[str]:
    """Every dotted field of a ConfigDict, sub-dicts included (`rewards`, `rewards.mode`, ...)."""
    fields = []
    for key, value in config.items():
        fields.append(prefix + key)
        if hasattr(value, "items"):
            fields += _config_fields(value, prefix + key + ".")
    return fields


def unknown_config_override(argv, flag: str = "config") -> str | None:
    """One line naming the first `--config.x=...` override that is not a field of the config file, else None.

    ml_collections reports such a typo as a 53-line chained traceback ending in
    `AttributeError: "'x'"`; this names the field, the file and the closest
    valid fields (difflib over the dotted names).
    """
    import difflib
    import runpy

    path = None
    overrides = []
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{flag}="):
            path = arg.split("=", 1)[1]
        elif arg == f"--{flag}" and i + 1 < len(argv):
            path = argv[i + 1]
        elif arg.startswith(f"--{flag}."):
            overrides.append(arg[len(f"--{flag}."):].split("=", 1)[0])
    if path is None or not overrides:
        return None
    file, _, config_arg = path.partition(":")
    try:
        get_config = runpy.run_path(file)["get_config"]
        config = get_config(config_arg) if config_arg else get_config()
    except Exception:   # the file itself is broken: ml_collections' own error says how
        return None
    fields = _config_fields(config)
    for name in overrides:
        if name not in fields:
            close = difflib.get_close_matches(name, fields, n=3, cutoff=0.5)
            hint = (f"did you mean {', '.join(close)}?" if close
                    else f"top-level fields: {', '.join(f for f in fields if '.' not in f)}")
            return f"--{flag}.{name}: {file} has no field {name!r}; {hint}"
    return None


def parse_flags(argv):
    """absl's own flag parsing (app.run's default), except that an unknown `--config.x` override exits with
    one line (exit status 1) instead of a traceback. Pass as `app.run(main, flags_parser=parse_flags)`."""
    import sys

    from absl import app

    try:
        return app.parse_flags_with_usage(argv)
    except (AttributeError, KeyError):
        message = unknown_config_override(argv)
        if message is None:
            raise
        sys.exit(message)
