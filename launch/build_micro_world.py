"""Builds the embedded micro-world: a tiny Qwen3.5 base model trained on the embedded suite (train split).

    python launch/build_micro_world.py                      # seed 0 into wmrl_jax/assets/micro_world (what ships)
    python launch/build_micro_world.py --seeds=0,1,2        # 3 builds; ships the best by a train-split check
    python launch/build_micro_world.py --out /tmp/mw --steps 3
    python launch/build_micro_world.py --out /tmp/mw --set=outcome_stage_steps=100 --set=agent_stage_steps=50

The default recipe (the mixed schedule with the outcome stream, then 200
world-model stage steps on the world model's own copy, written to
`<out>/world_model/`, and 100 agent stage steps; docs/results.md) takes
about 44 minutes on 2 idle CPU cores (2,605 s for seed 1); the first
micro-world's (`--set=outcome_batch_size=0 --set=outcome_stage_steps=0
--set=separate_world_model=False --set=agent_stage_steps=0`) about 8-9. Deterministic for a given seed, --set and code
(build_log.json records every step's loss) and resumable (started again
with the same flags it continues from `<out>.partial`). With several
seeds, each is built into `<out>.seed<k>` and checked on the TRAIN tasks
only (`micro_world.train_split_check`, with the recipe's world-model
readout: the agent's valid rate, then the world model's Spearman on logged
train programs, the lower of as they are and with the columns renamed); the best is copied to `--out`. The held-out tasks never
choose the shipped weights.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

from absl import app, flags

import bench_common  # noqa: F401  (importing it quiets absl/JAX INFO logs)

# Runnable as `python launch/build_micro_world.py` from a checkout without installing.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from wmrl_jax import micro_world  # noqa: E402

_OUT = flags.DEFINE_string("out", str(micro_world.shipped_path()), "Checkpoint folder to write.")
_STEPS = flags.DEFINE_integer("steps", None, "Training steps (default: the config's budget).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the corpus order, tokenizer sample, init and batches.")
_SEEDS = flags.DEFINE_list("seeds", None, "Several seeds: build each, ship the best by the train-split check.")
_SET = flags.DEFINE_multi_string(
    "set", [], "FIELD=VALUE: a MicroWorldConfig field changed for this build (repeatable), e.g. "
    "--set=outcome_stage_steps=200 --set=outcome_stage_alternate=True. Recorded in build_log.json's config.")


def config_from_flags(settings, seed: int):
    """The default MicroWorldConfig with `settings` ("FIELD=VALUE" strings) applied and `seed` set.

    FIELD is a field of MicroWorldConfig, or of its agent / world-model config as ``world_model.listing``.
    Values are parsed as the field's type (int, float, str; bool accepts true/false/1/0); an unknown field
    or a value that does not parse raises ValueError naming it and what was expected.
    """
    import dataclasses

    config = micro_world.MicroWorldConfig()

    def settable(obj, prefix=""):
        out = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                out.update(settable(value, f"{prefix}{f.name}."))
            elif type(value) in (int, float, bool, str) and f"{prefix}{f.name}" != "seed":
                out[f"{prefix}{f.name}"] = type(value)
        return out

    fields = settable(config)
    changes: dict[str, dict] = {}
    for setting in settings:
        name, sep, text = (part.strip() for part in setting.partition("="))
        if name == "seed":
            raise ValueError("--set: the seed is set with --seed or --seeds, not --set")
        if not sep or name not in fields:
            raise ValueError(f"--set: got {setting!r}, expected FIELD=VALUE with FIELD one of {sorted(fields)}")
        kind = fields[name]
        try:
            if kind is bool:
                if text.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(text)
                value = text.lower() in ("true", "1")
            else:
                value = kind(text)
        except ValueError:
            raise ValueError(f"--set: {name}={text!r} is not a valid {kind.__name__}") from None
        outer, _, inner = name.rpartition(".")
        changes.setdefault(outer, {})[inner] = value
    nested = {outer: dataclasses.replace(getattr(config, outer), **values)
              for outer, values in changes.items() if outer}
    return dataclasses.replace(config, **changes.get("", {}), **nested, seed=seed)


def _build(out: str, seed: int) -> dict:
    config = config_from_flags(_SET.value, seed)
    log = micro_world.build(out, config, steps=_STEPS.value)
    print(f"micro-world seed {seed}: {log['parameters'] / 1e6:.2f}M parameters, {log['steps']} steps of "
          f"{log['batch_size']} x {log['width']} tokens, reply loss {log['reply_nll'][0]:.3f} -> "
          f"{log['reply_nll'][-1]:.3f}, {log['seconds']:.0f} s -> {out}")
    return log


def _read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def main(argv):
    del argv
    if not _SEEDS.value:
        _build(_OUT.value, _SEED.value)
        return
    checks = {}
    for seed in map(int, _SEEDS.value):
        folder = f"{_OUT.value}.seed{seed}"
        log_path = os.path.join(folder, micro_world.BUILD_LOG)
        if not os.path.isfile(log_path):     # finished seeds are kept: the command resumes seed by seed
            _build(folder, seed)
        check_path = os.path.join(folder, "train_check.json")
        # A check from before the renamed-columns probe is redone.
        if not os.path.isfile(check_path) or "world_model_spearman_renamed" not in _read_json(check_path):
            readout = config_from_flags(_SET.value, seed).world_model.readout
            check = {**micro_world.train_split_check(folder, readout=readout), "readout": readout}
            with open(check_path, "w") as f:    # written once the check is done: an interrupted one is redone
                json.dump(check, f, indent=1)
        checks[seed] = _read_json(check_path)
        print(f"seed {seed} train-split check: {checks[seed]}")
    best = max(checks, key=lambda s: micro_world.pick_key(checks[s]))
    shutil.rmtree(_OUT.value, ignore_errors=True)
    shutil.copytree(f"{_OUT.value}.seed{best}", _OUT.value, ignore=shutil.ignore_patterns("train_check.json"))
    print(f"shipped seed {best} -> {_OUT.value}")


if __name__ == "__main__":
    app.run(main)
