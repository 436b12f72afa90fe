r"""SFT of the VLA policy on scripted-expert demonstrations (issue #30), with held-out initial states.

  python launch/vla_sft.py --demos /tmp/wmrl/demos --out /tmp/wmrl/vla_sft --held_out_states 40-49
  python launch/vla_eval.py --checkpoint /tmp/wmrl/vla_sft          # success on the held-out states, in LIBERO
  python launch/vla_sft.py --config configs/libero_long_minivla.py --backbone /models/Qwen2.5-0.5B   # MiniVLA-style

Reads every Episode file under --demos (launch/build_demos.py's
`<suite>/task<TT>/state<SS>.npz`; only successful episodes, the rest counted),
one sample per recorded frame: both cameras' images, the instruction in
OpenVLA's prompt, and the action the expert executed there, binned into 7
action tokens (`wmrl_jax.vla.demos`). Samples from --held_out_states never
train; their loss, token accuracy and greedy action error are reported
(`wmrl_jax.vla.sft`). The model is a `--preset` (a Qwen2 backbone and a ViT built
from scratch; "tiny" trains on 2 CPU cores) for the demos' frame size, with
the shipped micro-world tokenizer (its ids, then 256 action ids); or, with
`--backbone`, a pretrained HF checkpoint (MiniVLA's Qwen2.5-0.5B; any family
`models.load_hf` reads) with its own tokenizer, the preset sizing the ViT only
(`sft.from_hf_backbone`). `--config` takes a Python file whose `get_config()`
sets these flags (explicit flags win).

Writes to --out: `checkpoints/` (resumable: the same command continues, bit
for bit), then `policy/` (params.npz, config.json, meta.json, tokenizer/:
what vla_eval loads), `metrics.json` (per-step loss / accuracy / learning
rate, held-out records, the data report, final train and held-out metrics) and
`loss.png`. Rerun once finished, it says so and changes nothing. Exit status 2,
with one line, for bad arguments or demonstrations the model cannot use.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

import bench_common  # noqa: F401  (importing it quiets absl/JAX INFO logs; launch/ is on the path as a script)

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def config_defaults(path: pathlib.Path, dests: set[str]) -> dict:
    """The flag values a --config file sets (its `get_config()`'s keys are this script's flag names)."""
    import importlib.util

    if not path.is_file():
        raise ValueError(f"--config {path}: no such file (expected a Python file with get_config(), e.g. "
                         f"configs/libero_long_minivla.py)")
    spec = importlib.util.spec_from_file_location(f"vla_sft_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ValueError(f"--config {path}: no get_config() function")
    values = dict(module.get_config())
    unknown = sorted(set(values) - dests)
    if unknown:
        raise ValueError(f"--config {path}: unknown field(s) {unknown}; expected flags of vla_sft.py: {sorted(dests)}")
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}


def parse_args(argv=None):
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", type=pathlib.Path, default=None,
                     help="a Python file whose get_config() sets this script's flags (explicit flags win), e.g. "
                          "configs/libero_long_minivla.py")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], parents=[pre])
    p.add_argument("--demos", type=pathlib.Path, default=None, help="folder of Episode .npz files (build_demos --out)")
    p.add_argument("--backbone", type=pathlib.Path, default=None,
                   help="an HF checkpoint folder (weights + tokenizer, e.g. Qwen2.5-0.5B) as the backbone; the "
                        "preset then sizes the ViT only (default: the preset's backbone from scratch)")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp/wmrl/vla_sft"))
    p.add_argument("--steps", type=int, default=2000, help="optimizer updates")
    p.add_argument("--batch", type=int, default=32, help="samples per update")
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (warm-up, then cosine to 10 %%)")
    p.add_argument("--warmup", type=int, default=50, help="warm-up updates (at most steps / 2)")
    p.add_argument("--seed", type=int, default=0, help="initialisation and batch order")
    p.add_argument("--held_out_states", default="", help="initial-state indices never trained on, e.g. 40-49 or 3,7 "
                   "(the same for every task; vla_eval's default states)")
    p.add_argument("--preset", default="tiny", help="model size: tiny (2 CPU cores) or small")
    p.add_argument("--image_size", type=int, default=None, help="frame side the model reads (default: the demos')")
    p.add_argument("--cameras", nargs="+", default=["agentview", "wrist"], help="cameras the model reads")
    p.add_argument("--frame_stride", type=int, default=1, help="keep every k-th recorded frame of each episode")
    p.add_argument("--eval_every", type=int, default=100, help="held-out metrics every N steps (0: at the end only)")
    p.add_argument("--eval_samples", type=int, default=256, help="held-out samples scored (evenly spaced)")
    p.add_argument("--save_every", type=int, default=100, help="checkpoint every N steps (and at the end)")
    p.add_argument("--tokenizer", type=pathlib.Path, default=None,
                   help="an HF tokenizer folder (default: the shipped micro-world's)")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    config = pre.parse_known_args(argv)[0].config
    if config is not None:
        try:
            p.set_defaults(**config_defaults(config, {a.dest for a in p._actions} - {"help", "config"}))
        except ValueError as e:
            p.error(str(e))
    args = p.parse_args(argv)
    if args.demos is None:
        p.error("the following arguments are required: --demos (or a --config that sets demos)")
    args.demos, args.out = pathlib.Path(args.demos), pathlib.Path(args.out)
    args.backbone = pathlib.Path(args.backbone) if args.backbone else None
    return args


def main(argv=None) -> int:
    args = parse_args(argv)

    import jax
    import numpy as np

    from wmrl_jax import files, micro_world
    from wmrl_jax.models.tokenizer import import_transformers
    from wmrl_jax.vla import demos, sft
    from wmrl_jax.vla import model as vla

    t0 = time.perf_counter()
    try:   # everything checkable is checked before the model is built
        held = demos.parse_indices(args.held_out_states)
        sft_config = sft.SFTConfig(steps=args.steps, batch_size=args.batch, lr=args.lr, warmup_steps=args.warmup,
                                   seed=args.seed, eval_every=args.eval_every, eval_samples=args.eval_samples,
                                   save_every=args.save_every)
        if args.preset not in sft.PRESETS:
            raise ValueError(f"--preset {args.preset!r}: expected one of {sorted(sft.PRESETS)}")
        if args.frame_stride < 1:
            raise ValueError(f"--frame_stride {args.frame_stride}: expected >= 1")
        image_size = args.image_size or demos.frame_size(args.demos, args.cameras[0])
        backbone_params = None
        if args.backbone is not None:   # a pretrained backbone with its own tokenizer
            if args.tokenizer is not None:
                raise ValueError("--tokenizer with --backbone: the backbone's own tokenizer is used (expected one)")
            pretrained = sft.from_hf_backbone(args.backbone, vision_preset=args.preset, image_size=image_size,
                                              cameras=tuple(args.cameras))
            config, tokenizer, backbone_params = pretrained.config, pretrained.tokenizer, pretrained.backbone_params
        else:
            tok_path = sft.check_tokenizer_folder(args.tokenizer or micro_world.shipped_path(), "--tokenizer")
            tokenizer = import_transformers().AutoTokenizer.from_pretrained(tok_path)
            config = sft.preset(args.preset, vocab_size=sft.vocab_size_for(tokenizer), image_size=image_size,
                                cameras=tuple(args.cameras), pad_token_id=tokenizer.pad_token_id)
        samples, report = demos.load(args.demos, config, tokenizer, frame_stride=args.frame_stride)
        train_set, held_out = demos.split_by_state(samples, held)
    except (ValueError, FileNotFoundError) as e:
        print(f"vla_sft: {e}", file=sys.stderr)
        return 2

    out = args.out
    policy_dir = out / "policy"
    skipped = ", ".join(f"{s} {c}" for s, c in report["skipped_by_status"].items()) or "none"
    print(f"demos: {report['episodes_used']} successful episodes of {report['files']} files (skipped: {skipped}; "
          f"{report['failed_records']} failed.json records), {report['samples']} samples, tasks "
          f"{[t for _, t in samples.tasks]}, states {samples.states}, frames {image_size}px "
          f"({report['image_bytes'] / 2**20:.0f} MiB)")
    print(f"split: {len(train_set)} train samples (states {train_set.states}), {len(held_out)} held-out samples "
          f"(states {held}{'' if len(held_out) else ': no demonstrations of them, held-out loss not measured'})")
    params0 = jax.eval_shape(lambda: vla.init(config, jax.random.key(0)))
    n_params = int(sum(np.prod(x.shape) for x in jax.tree.leaves(params0)))
    family = type(config.backbone).__name__.removesuffix("Config")
    origin = f"pretrained {args.backbone}" if args.backbone is not None else "from scratch"
    print(f"model: preset {args.preset}, {n_params / 1e6:.2f}M parameters ({family} backbone {origin}, "
          f"{config.backbone.hidden_size}x{config.backbone.num_layers}, vocab {config.backbone.vocab_size}; ViT "
          f"{config.vision.width}x{config.vision.num_layers}, {config.image_tokens} image tokens)")
    params = None if backbone_params is None else \
        vla.init(config, jax.random.key(sft_config.seed), backbone_params=backbone_params)

    try:
        result = sft.train(config, train_set, sft_config, out, held_out=held_out if len(held_out) else None,
                           params=params, progress=not args.no_progress)
    except ValueError as e:   # a checkpoint of another run in --out
        print(f"vla_sft: {e}", file=sys.stderr)
        return 2
    if result.resumed_from >= args.steps and (policy_dir / "params.npz").is_file() and (out / "metrics.json").is_file():
        print(f"already at step {result.step} of {args.steps}: {out} unchanged")
        return 0

    final = {"train": sft.evaluate(result.params, config, train_set, batch_size=args.batch, limit=args.eval_samples)}
    if len(held_out):
        final["held_out"] = result.history["held_out"][-1]
    suites = sorted({s for s, _ in samples.tasks})
    meta = {"suite": suites[0] if len(suites) == 1 else None, "suites": suites,
            "tasks": sorted({t for _, t in samples.tasks}), "train_states": train_set.states,
            "held_out_states": held, "demos": str(args.demos), "steps": result.step, "preset": args.preset,
            "backbone": None if args.backbone is None else str(args.backbone),
            "sft": dataclasses.asdict(sft_config), "final": final}
    sft.save_policy(policy_dir, result.params, config, tokenizer, meta)
    metrics = {**meta, "data": report, "split": {"train_samples": len(train_set), "held_out_samples": len(held_out)},
               "parameters": n_params, "history": result.history, "resumed_from": result.resumed_from,
               "wall_s": round(time.perf_counter() - t0, 1), "jax": jax.__version__,
               "backend": jax.default_backend()}
    files.write_text_atomic(out / "metrics.json", json.dumps(metrics, indent=1) + "\n")
    files.write_atomic(out / "loss.png", lambda p: sft.plot_history(
        result.history, p, title=f"VLA SFT: preset {args.preset}, {len(train_set)} train samples, held-out states {held or 'none'}"))
    line = f"step {result.step}: train loss {final['train']['loss']:.3f}, token accuracy {final['train']['accuracy']:.3f}, " \
           f"greedy |action error| {final['train']['action_l1']:.3f}"
    if "held_out" in final:
        h = final["held_out"]
        line += f"; held-out loss {h['loss']:.3f}, accuracy {h['accuracy']:.3f}, |action error| {h['action_l1']:.3f}"
    print(line)
    print(f"wrote {policy_dir}/, {out / 'metrics.json'} and {out / 'loss.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
