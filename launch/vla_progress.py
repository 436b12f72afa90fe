r"""The VLA track's progress world model (issue #30): train it on demonstrations and failed rollouts, then measure
its fidelity against the simulator's success on held-out initial states.

  # failed rollouts: each demonstration replayed open loop with Gaussian action noise (needs LIBERO; resumable)
  MUJOCO_GL=egl python launch/vla_progress.py --demos /tmp/wmrl/demos --rollouts /tmp/wmrl/rollouts \
      --perturb_noise 0.25 0.5 --perturb_only
  # train (resumable) and report fidelity on the held-out states
  python launch/vla_progress.py --demos /tmp/wmrl/demos --rollouts /tmp/wmrl/rollouts --held_out_states 7-9 \
      --out /tmp/wmrl/progress

Reads every `simulator.Episode` .npz under --demos and --rollouts (any
status; unknown and running episodes excluded, counted). Targets: t/T on a
success, 0 on a failure (`--failure_label zero`; `time` labels failures t/T
too): see `wmrl_jax.vla.progress`. Episodes of --held_out_states never
train. The model is a `vla_sft` preset's architecture (ViT + Qwen2 backbone
from scratch, the shipped micro-world tokenizer) with a sigmoid progress
head. Failed rollouts can be made here (`--perturb_noise`): each successful
demonstration's actions replayed open loop from its own initial state with
i.i.d. Gaussian noise of each given std added (clipped to [-1, 1]; seeded by
(seed, task, state, noise)), in `SimPool` with the demos' cameras and frame
size and the demo's step count as the budget, saved as
`<rollouts>/<suite>/task<TT>/state<SS>.noise<σ>.npz` with the simulator's
outcome. Existing files are skipped: rerun to resume.

Writes to --out: `checkpoints/` (a rerun resumes, bit for bit), `model/`
(params.npz, config.json, meta.json, tokenizer/: `progress.load_model`),
`fidelity.json`, `fidelity.md` and `fidelity.png` (calibration and
progress-vs-time curves): per collapse mode (`potential`, the paper's
shaping, `final`, `max`, `success`; `--collapse` picks the headline one),
AUC and Spearman of the collapsed score with the held-out episodes' real
success, reliability bins of the final frame's progress as P(success), and
the cost of one prediction (8 frames, after compilation) against one real
episode's simulator time. Bad input (a missing folder, no episodes, an
unknown collapse mode or preset, frames of another size) is one line and exit
status 2 before any compute.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import bench_common  # noqa: F401  (importing it quiets absl/JAX INFO logs; launch/ is on the path as a script)

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--demos", type=pathlib.Path, required=True, help="folder of successful Episode .npz files "
                   "(build_demos --out)")
    p.add_argument("--rollouts", type=pathlib.Path, default=None, help="folder of rollout Episodes (failures and "
                   "successes; written here with --perturb_noise)")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp/wmrl/progress"))
    p.add_argument("--held_out_states", default="", help="initial-state indices never trained on, e.g. 7-9; the "
                   "fidelity is measured on their episodes")
    p.add_argument("--collapse", default="potential", help="headline collapse mode: potential, final, max, success")
    p.add_argument("--k", type=int, default=3, help="potential: frames averaged at each end")
    p.add_argument("--frames", type=int, default=8, help="frames sampled evenly over a rollout for its score")
    p.add_argument("--failure_label", default="zero", help="progress target of a failed rollout's frames: zero or time")
    p.add_argument("--steps", type=int, default=600, help="optimizer updates")
    p.add_argument("--batch", type=int, default=32, help="frames per update")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (warm-up, then cosine to 10 %%)")
    p.add_argument("--warmup", type=int, default=50, help="warm-up updates")
    p.add_argument("--seed", type=int, default=0, help="initialisation, batch order and the perturbation noise")
    p.add_argument("--preset", default="tiny", help="model size (vla_sft's presets): tiny or small")
    p.add_argument("--image_size", type=int, default=None, help="frame side the model reads (default: the demos')")
    p.add_argument("--cameras", nargs="+", default=["agentview", "wrist"], help="cameras the model reads")
    p.add_argument("--frame_stride", type=int, default=2, help="train on every k-th frame of each episode")
    p.add_argument("--eval_every", type=int, default=100, help="held-out loss every N steps (0: at the end only)")
    p.add_argument("--eval_samples", type=int, default=512, help="held-out frames scored during training")
    p.add_argument("--save_every", type=int, default=100, help="checkpoint every N steps (and at the end)")
    p.add_argument("--perturb_noise", type=float, nargs="*", default=[], help="make failed rollouts first: replay "
                   "each demo with this action-noise std (one rollout per value), into --rollouts")
    p.add_argument("--perturb_only", action="store_true", help="only make the perturbed rollouts, then stop")
    p.add_argument("--rollouts_only", action="store_true", help="train and measure on --rollouts alone (--demos "
                   "only sources the replays: with --perturb_noise 0 among them, successes and failures are "
                   "recorded alike)")
    p.add_argument("--render", default="egl", help="MUJOCO_GL backend for --perturb_noise")
    p.add_argument("--no_progress", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def check_args(args):
    """Everything checkable before compute: ValueError / FileNotFoundError with one line. Returns the held-out
    states and the frame size."""
    from wmrl_jax.vla import demos, progress, sft

    progress.check_mode(args.collapse)
    if args.failure_label not in progress.FAILURE_LABELS:
        raise ValueError(f"--failure_label {args.failure_label!r}: expected one of {progress.FAILURE_LABELS}")
    if args.preset not in sft.PRESETS:
        raise ValueError(f"--preset {args.preset!r}: expected one of {sorted(sft.PRESETS)}")
    if not 1 <= args.k <= args.frames:
        raise ValueError(f"--k {args.k} --frames {args.frames}: expected 1 <= k <= frames")
    if args.frame_stride < 1:
        raise ValueError(f"--frame_stride {args.frame_stride}: expected >= 1")
    if any(not s >= 0 for s in args.perturb_noise):
        raise ValueError(f"--perturb_noise {args.perturb_noise}: expected standard deviations >= 0 (0: the demo "
                         f"replayed exactly, re-recorded as the perturbed ones are)")
    if (args.perturb_noise or args.perturb_only) and args.rollouts is None:
        raise ValueError("--perturb_noise / --perturb_only: expected --rollouts, the folder to write them to")
    if args.rollouts_only and args.rollouts is None:
        raise ValueError("--rollouts_only: expected --rollouts, the folder of episodes to train on")
    if args.perturb_only and not args.perturb_noise:
        raise ValueError("--perturb_only without --perturb_noise: expected the noise std(s) of the rollouts to make")
    held = demos.parse_indices(args.held_out_states)
    size = demos.frame_size(args.demos, args.cameras[0])   # a missing or empty --demos: one line here
    if args.image_size is not None and args.image_size != size:
        raise ValueError(f"--image_size {args.image_size}: the demos' {args.cameras[0]} frames are {size}x{size} "
                         f"(expected the same size; record them with build_demos --camera_size {args.image_size})")
    sft._vision(args.preset, size, tuple(args.cameras))   # the preset's patch grid must divide the frames
    if args.rollouts is not None and not args.perturb_noise:
        rsize = demos.frame_size(args.rollouts, args.cameras[0])
        if rsize != size:
            raise ValueError(f"--rollouts {args.rollouts}: {args.cameras[0]} frames of {rsize}x{rsize}, expected the "
                             f"demos' {size}x{size}")
    return held, size


def perturb(args, size: int) -> list[pathlib.Path]:
    """The perturbed replays of every successful demo (module docstring); returns the files written.

    A replay's step budget is its demo's step count, so it ends inside the pool as a success or a failure
    with its full record (a pool returns a still-running episode without frames). Every replay runs in a
    freshly built scene (a new pool): a scene reused across resets renders the same state slightly
    differently (measured here: identical proprio, up to ~200 of 255 apart on some pixels at 64 px), and a
    model fed successes from one kind and failures from the other learns the renderer, not progress."""
    import collections

    import numpy as np
    import tqdm

    import simulator
    from wmrl_jax.vla import demos

    simulator.require_benchmark()
    sources = demos._episode_files(args.demos)
    by_task = collections.defaultdict(list)
    for path in sources:
        ep = demos._load_one(path)
        if ep.status == "success":
            by_task[(ep.suite, ep.task_id)].append(ep)
    todo = []
    for (suite, task), eps in sorted(by_task.items()):
        for ep in eps:
            budget = ep.steps
            for sigma in args.perturb_noise:
                out = args.rollouts / suite / f"task{task:02d}" / f"state{ep.init_state_index:02d}.noise{sigma:.2f}.npz"
                if not out.exists():
                    todo.append((ep, sigma, out, budget))
    written, pool = [], None
    outcomes = {"success": 0, "failure": 0, "unknown": 0}
    bar = tqdm.tqdm(todo, desc="perturbed replays", unit="ep", disable=args.no_progress)
    for ep, sigma, out, budget in bar:
        if pool is not None:
            pool.close()
        pool = simulator.SimPool(ep.suite, workers=1, cameras=tuple(args.cameras), camera_size=size,
                                 max_steps=budget, render=args.render)
        rng = np.random.default_rng([args.seed, ep.task_id, ep.init_state_index, round(sigma * 1000)])
        actions = np.clip(ep.actions + sigma * rng.standard_normal(ep.actions.shape), -1, 1).astype(np.float32)
        pool.reset([(ep.task_id, ep.init_state_index)])
        pool.step(actions[None])
        rec = pool.episodes[0]
        out.parent.mkdir(parents=True, exist_ok=True)
        written.append(rec.save(out))
        outcomes[rec.status] = outcomes.get(rec.status, 0) + 1
        bar.set_postfix(outcomes)
    bar.close()
    if pool is not None:
        pool.close()
    n_all = sum(len(v) for v in by_task.values()) * len(args.perturb_noise)
    print(f"perturbed replays: {len(written)} written ({outcomes}), {n_all - len(todo)} already there")
    return written


def plot(path, curves: dict, calibration: dict, title: str) -> None:
    """Left: reliability of the final frame's progress as P(success); right: mean predicted progress against
    t/T on held-out successes and failures, with the targets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    bins = [b for b in calibration["bins"] if b["count"]]
    ax1.plot([0, 1], [0, 1], "--", color="gray", lw=1, label="perfectly calibrated")
    ax1.plot([b["mean_pred"] for b in bins], [b["rate"] for b in bins], "o-", color="tab:blue",
             label=f"held-out episodes (ECE {calibration['ece']:.2f})")
    for b in bins:
        ax1.annotate(str(b["count"]), (b["mean_pred"], b["rate"]), textcoords="offset points", xytext=(4, -10),
                     fontsize=7)
    ax1.set_xlabel("final-frame progress (as P(success))")
    ax1.set_ylabel("real success rate")
    ax1.set_xlim(-0.02, 1.02)
    ax1.set_ylim(-0.02, 1.02)
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    for name, plural, color in (("success", "successes", "tab:green"), ("failure", "failures", "tab:red")):
        c = curves.get(name)
        if not c:
            continue
        ax2.plot(c["t"], c["mean"], "-", color=color, label=f"predicted, {plural} ({c['episodes']}; band: min-max)")
        ax2.fill_between(c["t"], c["lo"], c["hi"], color=color, alpha=0.15)
        ax2.plot(c["t"], c["target"], ":", color=color, label=f"target, {plural}")
    ax2.set_xlabel("t / T (fraction of the episode)")
    ax2.set_ylabel("progress")
    ax2.set_ylim(-0.02, 1.02)
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("MUJOCO_GL", args.render)
    try:
        held, size = check_args(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"vla_progress: {e}", file=sys.stderr)
        return 2
    if args.perturb_noise:
        try:
            perturb(args, size)
        except (RuntimeError, ValueError) as e:   # the benchmark missing, a render backend that cannot start
            print(f"vla_progress: {e}", file=sys.stderr)
            return 2
        if args.perturb_only:
            return 0

    import dataclasses

    import jax
    import numpy as np

    from wmrl_jax import files, micro_world
    from wmrl_jax.models.tokenizer import import_transformers
    from wmrl_jax.vla import demos, progress, sft

    t0 = time.perf_counter()
    tokenizer = import_transformers().AutoTokenizer.from_pretrained(micro_world.shipped_path())
    body = sft.preset(args.preset, vocab_size=sft.vocab_size_for(tokenizer), image_size=size,
                      cameras=tuple(args.cameras), pad_token_id=tokenizer.pad_token_id)
    config = progress.Config(body=body, failure_label=args.failure_label)
    tc = sft.SFTConfig(steps=args.steps, batch_size=args.batch, lr=args.lr, warmup_steps=args.warmup, seed=args.seed,
                       eval_every=args.eval_every, eval_samples=args.eval_samples, save_every=args.save_every)
    folders = ([] if args.rollouts_only else [args.demos]) + ([args.rollouts] if args.rollouts is not None else [])
    try:
        data, report = progress.load_episodes(folders, config, tokenizer)
    except demos.DemoError as e:
        print(f"vla_progress: {e}", file=sys.stderr)
        return 2
    print(f"episodes: {report['episodes']} of {report['files']} files ({report['successes']} successes, "
          f"{report['failures']} failures, skipped {report['skipped_by_status'] or 'none'}), {report['frames']} "
          f"frames at {size}px ({report['image_bytes'] / 2**20:.0f} MiB)")
    train_eps = data.episode_ids(exclude_states=held)
    held_eps = data.episode_ids(states=held)
    if not train_eps:
        print(f"vla_progress: --held_out_states {held}: every episode is held out; expected some to train on",
              file=sys.stderr)
        return 2
    train_rows = data.rows(train_eps, args.frame_stride)
    held_rows = data.rows(held_eps, args.frame_stride)
    count = lambda ids: (sum(data.episodes[i]["success"] for i in ids), len(ids))  # noqa: E731
    print(f"split: train {count(train_eps)[1]} episodes ({count(train_eps)[0]} successes), {train_rows.size} frames "
          f"(stride {args.frame_stride}); held out (states {held}) {count(held_eps)[1]} episodes "
          f"({count(held_eps)[0]} successes)")
    n_params = int(sum(np.prod(x.shape) for x in jax.tree.leaves(jax.eval_shape(
        lambda: progress.init(config, jax.random.key(0))))))
    print(f"model: preset {args.preset} + progress head, {n_params / 1e6:.2f}M parameters")
    try:
        result = progress.train(config, data, train_rows, tc, args.out, held_out_rows=held_rows,
                                progress=not args.no_progress)
    except ValueError as e:   # a checkpoint of another run in --out
        print(f"vla_progress: {e}", file=sys.stderr)
        return 2
    params = result.params
    meta = {"demos": str(args.demos), "rollouts": None if args.rollouts is None else str(args.rollouts),
            "held_out_states": held, "train_states": sorted({data.episodes[i]["state"] for i in train_eps}),
            "tasks": sorted({e["task"] for e in data.episodes}), "steps": result.step, "preset": args.preset,
            "train": dataclasses.asdict(tc), "collapse": args.collapse, "k": args.k, "frames": args.frames,
            "frame_stride": args.frame_stride}
    progress.save_model(args.out / "model", params, config, tokenizer, meta)

    # Fidelity on the held-out episodes (and, for reference, the training ones).
    record = {**meta, "data": report, "parameters": n_params, "history": result.history,
              "resumed_from": result.resumed_from}
    for name, ids in (("held_out", held_eps), ("train", train_eps)):
        if not ids:
            continue
        scores = progress.score_episodes(params, config, data, ids, count=args.frames)
        success = np.array([data.episodes[i]["success"] for i in ids])
        fid = progress.fidelity(scores, success, k=args.k)
        fid["frame_mae"] = progress.evaluate(params, config, data, data.rows(ids), batch_size=args.batch)["mae"]
        fid["episodes_list"] = [{"task": data.episodes[i]["task"], "state": data.episodes[i]["state"],
                                 "success": bool(s), "path": data.episodes[i]["path"],
                                 "progress": [round(float(x), 4) for x in row]} for i, s, row in zip(ids, success, scores)]
        record[name] = fid
    # Cost: one rollout's score (its frames in one batch, compiled) against the simulator's time per episode.
    if held_eps:
        rows = data.sampled_rows(held_eps[0], args.frames)
        progress.predict(params, config, data, rows, batch_size=args.frames)   # compiled already; warm
        reps = 20
        t1 = time.perf_counter()
        for _ in range(reps):
            progress.predict(params, config, data, rows, batch_size=args.frames)
        per_pred = (time.perf_counter() - t1) / reps
        sim = [e["wall_s"] for e in data.episodes if e["wall_s"] > 0]
        record["cost"] = {"prediction_s": per_pred, "frames_per_prediction": args.frames,
                          "real_episode_s": float(np.mean(sim)) if sim else None,
                          "ratio": (per_pred / float(np.mean(sim))) if sim else None,
                          "backend": jax.default_backend()}
        # Progress against time, every frame of the held-out episodes, on a grid of t/T.
        grid = np.linspace(0, 1, 21)
        curves = {}
        all_rows = data.rows(held_eps)
        pred = progress.predict(params, config, data, all_rows, batch_size=args.batch)
        for label, want in (("success", True), ("failure", False)):
            per_ep = []
            for i in held_eps:
                e = data.episodes[i]
                if e["success"] != want:
                    continue
                m = data.episode[all_rows] == i
                per_ep.append(np.interp(grid, data.time[all_rows][m], pred[m]))
            if per_ep:
                a = np.stack(per_ep)
                tgt = grid if (want or args.failure_label == "time") else np.zeros_like(grid)
                curves[label] = {"t": grid.tolist(), "mean": a.mean(0).tolist(), "lo": a.min(0).tolist(),
                                 "hi": a.max(0).tolist(), "target": tgt.tolist(), "episodes": len(per_ep)}
        record["curves"] = curves
    record["wall_s"] = round(time.perf_counter() - t0, 1)
    record["jax"] = jax.__version__
    files.write_text_atomic(args.out / "fidelity.json", json.dumps(record, indent=1) + "\n")
    md = markdown(record, args.collapse)
    files.write_text_atomic(args.out / "fidelity.md", md)
    if "held_out" in record:
        files.write_atomic(args.out / "fidelity.png", lambda p: plot(
            p, record["curves"], record["held_out"]["calibration"],
            f"progress model on held-out states {held}: {record['held_out']['episodes']} episodes "
            f"({record['held_out']['successes']} successes)"))
    print(md)
    print(f"wrote {args.out / 'model'}/, fidelity.json, fidelity.md{', fidelity.png' if 'held_out' in record else ''}")
    return 0


def markdown(record: dict, headline: str) -> str:
    def f(x, fmt=".3f"):
        return "-" if x is None or x != x else format(x, fmt)

    lines = [f"# Progress model fidelity (headline collapse: {headline})", ""]
    for name in ("held_out", "train"):
        fid = record.get(name)
        if not fid:
            continue
        lines += [f"## {name.replace('_', '-')} episodes: {fid['episodes']} ({fid['successes']} successes); "
                  f"frame |error| {fid['frame_mae']:.3f}", "",
                  "| collapse | AUC [95 % bootstrap] | Spearman | mean score, successes | mean score, failures |",
                  "|---|---|---|---|---|"]
        for mode, m in fid["modes"].items():
            mark = " (headline)" if mode == headline else ""
            lo, hi = m["auc_ci95"]
            lines.append(f"| {mode}{mark} | {f(m['auc'])} [{f(lo, '.2f')}, {f(hi, '.2f')}] | {f(m['spearman'])} | "
                         f"{f(m['mean_success'])} | "
                         f"{f(m['mean_failure'])} |")
        cal = fid["calibration"]
        lines += ["", f"Reliability of the final frame's progress as P(success) (ECE {cal['ece']:.3f}):", "",
                  "| bin | episodes | mean predicted | real success rate |", "|---|---|---|---|"]
        lines += [f"| [{b['lo']:.1f}, {b['hi']:.1f}] | {b['count']} | {f(b['mean_pred'])} | {f(b['rate'])} |"
                  for b in cal["bins"]]
        lines.append("")
    cost = record.get("cost")
    if cost:
        lines.append(f"Cost: {1e3 * cost['prediction_s']:.1f} ms per prediction ({cost['frames_per_prediction']} "
                     f"frames, {cost['backend']}) vs {f(cost['real_episode_s'], '.1f')} s of simulator per real "
                     f"episode (ratio {f(cost['ratio'], '.1e')}).")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
