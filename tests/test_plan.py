"""launch/plan.py: XLA's memory figures against a hand count, FLOPs against 6·N·tokens, the fit decision, knobs.

The planner runs in subprocesses (its simulated device count must be set
before JAX starts) on the shipped micro-world config with shrunk caps, so
each compile takes seconds. The parameter count is transformers' (a meta-
device model built from the same config.json), independent of our code.
"""

import json
import math
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Shrunk shapes: update [16, 256], 2 turns of 32 new tokens, a 32-token world-model answer.
SMALL = ["--config=configs/tiny_cpu.py", "--prompt_tokens=96", "--wm_prompt_tokens=96",
         "--config.agent.max_turns=2", "--config.agent.max_new_tokens=32", "--config.agent.observation_max_tokens=16",
         "--config.world_model.max_new_tokens=32"]


def _plan(tmp_path, name, *args, devices=8, timeout=480):
    out = tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, "launch/plan.py", f"--devices={devices}", f"--json={out}", *SMALL, *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**__import__("os").environ, "XLA_FLAGS": ""})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(proc.stdout)
    return json.loads(out.read_text()), proc.stdout


def _hf_param_count() -> int:
    """Parameters of the micro-world as transformers builds it from its config.json (meta device: no memory)."""
    code = textwrap.dedent("""
        import torch, transformers
        from wmrl_jax import micro_world
        cfg = transformers.AutoConfig.from_pretrained(micro_world.shipped_path())
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        print(sum(p.numel() for p in model.parameters()))
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return int(proc.stdout.split()[-1])


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """fsdp 4 x tensor 2 on 8 devices, train + samplers, with enough HBM to fit."""
    tmp = tmp_path_factory.mktemp("plan")
    return _plan(tmp, "sharded", "--config.mesh.data=1", "--config.mesh.fsdp=4", "--config.mesh.tensor=2",
                 "--hbm_gb=100", "--mem_fraction=1.0")


def test_argument_bytes_are_the_hand_count_over_the_shards(sharded):
    out, text = sharded
    n = _hf_param_count()
    plan = out["plan"]
    assert plan["n_params"] == n                      # our param tree is transformers' model
    assert plan["mesh"] == {"data": 1, "fsdp": 4, "tensor": 2}
    shards = 4 * 2
    # float32 model (tiny_cpu): masters 4 B, Adam mu + nu 8 B, the frozen copy 4 B per parameter.
    hand = {"params (masters)": 4 * n, "optimizer state": 8 * n, "frozen reference = world model": 4 * n}
    # The frozen copy lives in the rollout layout (train.rollout): whole inside each group of rollout.tensor devices.
    rollout = plan["rollout"]
    assert rollout["layout"] == "rollout" and rollout["mesh"]["fsdp"] == 1
    group = rollout["mesh"]["tensor"]
    divisor = {"params (masters)": shards, "optimizer state": shards, "frozen reference = world model": group}
    for name, total in hand.items():
        per_device = plan["resident"][name]
        # Sharded weights divide exactly; the replicated ones (norms, biases: < 2 % here) add to every device.
        assert total / divisor[name] <= per_device <= 1.06 * total / divisor[name], (name, per_device, total)
    # XLA's own argument size = state + frozen copy + the batch's shard over data x fsdp = 4: 16 rows of what
    # follows the 4 groups' shared prompts (optim.share_prompt "auto": one group a shard), and the prompts.
    s = out["plan"]["shapes"]
    assert s["groups"] == 4 and s["prompt_width"] > 0 and s["train_width"] < s["prompt_width"] + 512
    batch = s["batch"] * s["train_width"] * (4 + 1 + 1) + 2 * 16 * 4 + s["groups"] * s["prompt_width"] * (4 + 1)
    expect = sum(total / divisor[name] for name, total in hand.items()) + batch / 4
    xla = plan["programs"]["train"]["arguments"]
    assert expect <= xla <= 1.06 * expect, (xla, expect)
    # The samplers' arguments are a parameter copy (+ a few row arrays); their KV caches sit in their temporaries.
    for name in ("sample", "wm"):
        prog = plan["programs"][name]
        assert prog["arguments"] >= 4 * n / shards
        assert prog["temporaries"] >= plan["kv_cache"]["agent" if name == "sample" else "world model"]
    assert "FITS" in text and out["fits"]
    # The reshard into the rollout layout is compiled and measured: its output is the policy copy in that layout.
    reshard = plan["programs"]["reshard"]
    copy = plan["resident"]["policy copy, model dtype (sampling only)"]
    assert copy <= reshard["outputs"] <= 1.01 * copy          # XLA pads small buffers a little
    assert plan["phases"]["reshard"] >= reshard["outputs"]
    for name in ("sample", "wm"):      # generation on the rollout layout: no weight all-gather in the decode loop
        assert plan["programs"][name]["decode_gathers"]["weight_all_gathers"] == 0
    # The bill, for scripts: per phase, the total, the ideal, the paper's hours (None for the micro-world).
    assert set(out["hours_by_phase"]) == {"update", "reshard", "agent prefill", "agent decode", "world model"}
    assert out["hours_total"] == sum(out["hours_by_phase"].values()) > out["hours_ideal"] > 0
    assert out["paper_hours"] is None and "blocked attention" in out["attention_kernel"]


def test_flops_are_of_the_order_of_6_n_tokens(sharded):
    out, _ = sharded
    plan, flops = out["plan"], out["flops"]
    train = plan["programs"]["train"]
    six_n = flops["6N"]
    # The jaxpr count adds the reference forward (2N), remat's recomputation (2N), the LM head's chunked
    # recompute and attention / delta-rule matmuls to 6N: between 6N and ~3x it.
    assert six_n < train["jaxpr_flops"] < 3 * six_n, (train["jaxpr_flops"], six_n)
    assert train["while_loops"] == 0            # every loop of the update is a scan: counted with its length
    assert 0.5 * six_n < flops["train"] < 3 * six_n
    # XLA's count is per device and counts loop bodies once: below the global count, not above it.
    assert 0 < train["xla_flops"] * plan["devices"] < train["jaxpr_flops"]


def test_fit_decision_flips_with_hbm_and_a_knob_makes_it_fit(tmp_path, sharded):
    out, _ = sharded
    train_peak = out["plan"]["phases"]["train"]
    # Just below the update's peak: it does not fit; micro-batches halve its activations, so 2 must fit.
    hbm_gib = 0.97 * train_peak / 2**30
    small, text = _plan(tmp_path, "small", "--config.mesh.data=1", "--config.mesh.fsdp=4", "--config.mesh.tensor=2",
                        f"--hbm_gb={hbm_gib:.6f}", "--mem_fraction=1.0", "--programs=train")
    assert not small["fits"] and "DOES NOT FIT" in text
    assert small["tries"][0]["knob"] == "optim.micro_batches 1 -> 2"
    assert small["tries"][-1]["fits"] and small["final_fits"]
    assert small["tries"][-1]["plan"]["phases"]["train"] < train_peak


def test_matmul_flops_counts_scan_lengths_and_xla_does_not():
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp
        from wmrl_jax.train.plan import matmul_flops
        w, x = jnp.ones((64, 64)), jnp.ones((8, 64))
        def f(w, x, n):
            return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=n)[0].sum()
        for n in (2, 6):
            jitted = jax.jit(f, static_argnums=2)
            count = matmul_flops(jitted.trace(w, x, n).jaxpr)
            print(n, count.flops, jitted.lower(w, x, n).compile().cost_analysis()["flops"])
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.strip().splitlines()]
    (n2, ours2, xla2), (n6, ours6, xla6) = [(int(a), float(b), float(c)) for a, b, c in rows]
    assert ours2 == 2 * 2 * 8 * 64 * 64 and ours6 == 6 * 2 * 8 * 64 * 64
    assert math.isclose(xla2, xla6, rel_tol=0.05)     # XLA: the loop body once, whatever the length
