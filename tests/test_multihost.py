"""Two training processes (jax.distributed on localhost, gloo) train exactly like one process.

`launch/train.py` runs three times at once, as subprocesses: once alone on 4
simulated CPU devices, and as 2 processes x 2 devices joined by
`--coordinator_address/--num_processes/--process_id`, the same global mesh
(data = 4). One step of the tiny config with the smallest loop-test settings
(a tiny random Qwen3 checkpoint, 2 tasks x 4 rollouts, 24 new tokens; as in
tests/test_train_loop.py's Qwen3 test). Sampling is row-local, so both runs
sample the same tokens; the gradients' all-reduce is gloo's across processes
in one run and XLA's in-process one in the other, so the params agree up to
float32 summation order: atol 1e-6, 1/50 of the one update's size (~lr, pinned
at 5e-5 here whatever tiny_cpu's own rate).

Every subprocess has a deadline; on failure or time-out all are killed and
their output is printed.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEADLINE_S = 780          # under pytest-timeout's 900 s; ~1-2 min on 2 idle cores, ~3 under heavy load
ATOL = 1e-6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_args(workdir: pathlib.Path, model: pathlib.Path) -> list[str]:
    overrides = {
        "workdir": workdir, "model_path": model, "steps": 1, "eval_attempts": 0,
        "rollout.groups_per_step": 2, "rollout.group_size": 4,
        "agent.max_new_tokens": 24, "agent.overview_chars": 300, "agent.inventory_chars": 100,
        "optim.learning_rate": 5e-5, "optim.warmup_steps": 1, "optim.remat": "none", "checkpoint.every": 1, "log.text_samples": 1,
        "rewards.min_pairs": 4, "rewards.refit_every": 2, "rewards.warmup": 1,
    }
    return [sys.executable, str(ROOT / "launch" / "train.py"), "--config=" + str(ROOT / "configs" / "tiny_cpu.py"),
            *(f"--config.{k}={v}" for k, v in overrides.items())]


def _start(name: str, args: list[str], devices: int, logs: pathlib.Path) -> tuple:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WMRL_", "JAX_COORDINATOR", "SLURM_", "OMPI_"))}
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""), TOKENIZERS_PARALLELISM="false")
    out = open(logs / f"{name}.log", "w")
    return name, subprocess.Popen(args, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT), out


def _run_all(jobs: list[tuple], logs: pathlib.Path) -> dict[str, str]:
    """Waits for every job; kills them all at the first failure or at the deadline. Returns each one's output."""
    deadline = time.monotonic() + DEADLINE_S
    failure = None
    try:
        while failure is None and any(p.poll() is None for _, p, _ in jobs):
            failed = [(n, p.returncode) for n, p, _ in jobs if p.poll() not in (None, 0)]
            if failed:
                failure = f"{failed[0][0]} exited with {failed[0][1]}"
            elif time.monotonic() > deadline:
                failure = f"not finished after {DEADLINE_S} s"
            time.sleep(1)
        if failure is None:
            failed = [(n, p.returncode) for n, p, _ in jobs if p.returncode != 0]
            failure = f"{failed[0][0]} exited with {failed[0][1]}" if failed else None
    finally:
        for _, p, out in jobs:
            if p.poll() is None:
                p.kill()
                p.wait()
            out.close()
    outputs = {n: (logs / f"{n}.log").read_text(errors="replace") for n, _, _ in jobs}
    if failure:
        tails = "\n".join(f"===== {n} (exit {p.returncode}) =====\n{outputs[n][-4000:]}" for n, p, _ in jobs)
        pytest.fail(f"training subprocesses: {failure}\n{tails}")
    return outputs


def _params(export: pathlib.Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(export / "model.safetensors")


@pytest.mark.slow
def test_two_processes_train_the_same_params_as_one(tmp_path):
    from tests.helpers_hf import save_tiny_qwen3
    from wmrl_jax.train.metrics import read_scalars

    model = save_tiny_qwen3(tmp_path / "qwen3", seed=0)
    logs = tmp_path / "logs"
    logs.mkdir()
    one, two = tmp_path / "one_process", tmp_path / "two_processes"
    multi = [f"--coordinator_address=127.0.0.1:{_free_port()}", "--num_processes=2"]
    outputs = _run_all([
        _start("single", _train_args(one, model), 4, logs),
        _start("process0", _train_args(two, model) + multi + ["--process_id=0"], 2, logs),
        _start("process1", _train_args(two, model) + multi + ["--process_id=1"], 2, logs),
    ], logs)

    # The same params, up to summation order; and they did move (by ~lr), so the comparison means something.
    before, a, b = _params(model), _params(one / "export"), _params(two / "export")
    assert a.keys() == b.keys()
    moved = max(float(np.abs(a[k] - before[k]).max()) for k in a)
    assert moved > 20 * ATOL, f"the update moved no param by more than {moved}"
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=0, atol=ATOL, err_msg=k)

    # The same rollouts, rewards and sandbox runs (run once, on process 0, and shared).
    sa, sb = read_scalars(one / "tb"), read_scalars(two / "tb")
    assert sa.keys() == sb.keys()
    for tag in sa:
        if tag.startswith("time/") or tag == "cost/sandbox_cpu_s":
            continue
        x, y = sa[tag][-1][1], sb[tag][-1][1]
        if tag.startswith("train/"):
            assert y == pytest.approx(x, rel=1e-5, abs=1e-7, nan_ok=True), tag
        else:
            assert (np.isnan(x) and np.isnan(y)) or x == y, tag
    assert sb["cost/real_executions"][-1][1] == 4        # one anchor group of 4, not 4 per process

    # One writer: process 0 printed the summary and wrote one event file; both wrote the checkpoint (Orbax).
    assert "real executions" in outputs["process0"] and "real executions" not in outputs["process1"]
    assert len(list((two / "tb").iterdir())) == 1
    assert (two / "checkpoints" / "1").is_dir() and (two / "summary.json").is_file()
