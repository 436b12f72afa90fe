"""configs/*.py: each loads through `config_flags` (with --config.x=y overrides), matches its model
preset's published size, converts to the agent / world-model dataclasses, and `validate` names the
field that is wrong."""

from __future__ import annotations

import pathlib

import pytest
from absl import flags
from ml_collections import config_flags

from wmrl_jax import micro_world
from wmrl_jax.agent import AgentConfig
from wmrl_jax.models import qwen35
from wmrl_jax.train.config import agent_config, resolve_mesh, validate, world_model_config
from wmrl_jax.world_model import WorldModelConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = ("tiny_cpu", "mle_dojo_4b", "mle_dojo_9b", "dsbench_4b", "dsbench_9b")
PAPER = CONFIGS[1:]


def load(name: str, *overrides: str):
    """The ConfigDict `python launch/train.py --config=configs/<name>.py <overrides>` would get."""
    argv = ["train.py", f"--config={ROOT / 'configs' / f'{name}.py'}", *overrides]
    values = flags.FlagValues()
    # The overrides are read from sys_argv (sys.argv by default), the flag itself from the parsed argv.
    config_flags.DEFINE_config_file("config", None, "run config", flag_values=values, sys_argv=argv)
    values(argv)
    return values.config


@pytest.fixture
def model_dir(tmp_path):
    """A folder that passes for an HF checkpoint (validate only looks for config.json)."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "data").mkdir()
    return tmp_path


def runnable(name: str, model_dir: pathlib.Path, *overrides: str):
    """`name` with its placeholders replaced by real folders."""
    paths = [f"--config.model_path={model_dir / 'model'}"]
    if name != "tiny_cpu":
        paths.append(f"--config.data_dir={model_dir / 'data'}")
    return load(name, *paths, *overrides)


@pytest.mark.parametrize("name", CONFIGS)
def test_config_loads_and_its_docstring_has_the_command(name):
    config = load(name)
    assert config.optim.total_steps == config.steps
    text = (ROOT / "configs" / f"{name}.py").read_text()
    assert f"python launch/train.py --config=configs/{name}.py" in text.split('"""')[1]


@pytest.mark.parametrize("name", PAPER)
def test_paper_configs_have_the_papers_hyper_parameters(name):
    c = load(name)
    assert (c.steps, c.optim.learning_rate, c.optim.kl_coef, c.optim.entropy_coef) == (3200, 1e-6, 0.04, 0.002)
    assert (c.rollout.groups_per_step, c.rollout.group_size, c.rewards.min_anchors) == (8, 8, 2)
    assert agent_config(c) == AgentConfig()              # <= 4 turns, 4096 tokens, 1024-token observations, 600 s
    assert world_model_config(c) == WorldModelConfig()   # T 0.7, top-p 0.8, top-k 20, <= 1024 tokens
    assert c.dtype == "bfloat16" and c.optim.param_dtype == "float32"


def test_tiny_cpu_takes_the_micro_worlds_prompts_and_sampling():
    c = load("tiny_cpu")
    micro = micro_world.MicroWorldConfig()
    assert agent_config(c) == micro.agent
    assert world_model_config(c) == micro.world_model
    assert c.model_path == "" and c.data_dir == "" and c.benchmark == "embedded"


def test_parameter_counts_match_the_published_sizes(launch_script):
    published = launch_script("param_count").PUBLISHED
    for name in PAPER:
        preset = load(name).model_preset
        size, _ = published[preset]
        # The 4B model card rounds to "4B" (ours 4.206B); the 9B's text weights are published as 8.95B.
        tolerance = 0.06 if preset == "qwen3.5-4b" else 1e-3
        assert qwen35.num_params(qwen35.PRESETS[preset]) == pytest.approx(size, rel=tolerance), name
    micro = micro_world.MicroWorldConfig()
    count = qwen35.num_params(micro.model_config(micro.vocab_size, eos_id=2, pad_id=0))
    # 4.5M at the config's 4096-row vocabulary; 4.0M as shipped (2112 rows, the docstrings' figure)
    assert load("tiny_cpu").model_preset == "micro" and 4.0e6 < count < 5.0e6


def test_overrides_through_config_flags(model_dir):
    c = load("tiny_cpu", "--config.rewards.mode=real", "--config.steps=7", "--config.optim.micro_batches=2")
    assert (c.rewards.mode, c.steps, c.optim.total_steps, c.optim.micro_batches) == ("real", 7, 7, 2)
    validate(runnable("tiny_cpu", model_dir, "--config.rewards.mode=real"), device_count=1)
    with pytest.raises(ValueError, match=r"config.rewards.mode: 'bogus', expected one of \('real'"):
        validate(runnable("tiny_cpu", model_dir, "--config.rewards.mode=bogus"), device_count=1)


@pytest.mark.parametrize("name", PAPER)
def test_paper_configs_validate_once_given_real_folders(name, model_dir):
    with pytest.raises(ValueError, match=r"config.model_path: '/path/to/Qwen3.5-\dB', expected an HF checkpoint"):
        validate(load(name), device_count=8)
    with pytest.raises(ValueError, match=r"config.data_dir: '/path/to/"):
        validate(load(name, f"--config.model_path={model_dir / 'model'}"), device_count=8)
    validate(runnable(name, model_dir), device_count=8)      # 4B: fsdp 4 x tensor 2, 16 micro-batches of 4


@pytest.mark.parametrize("overrides, device_count, pattern", [
    (["--config.optim.micro_batches=3"], 1, r"config.optim.micro_batches: 3, expected a divisor of the batch of "
                                           r"4 x 4 = 16"),
    (["--config.mesh.fsdp=8", "--config.optim.micro_batches=4"], 8, r"config.optim.micro_batches: 4, expected "
                                                                   r"micro-batches of 16 / 4 = 4 sequences"),
    (["--config.mesh.fsdp=3"], 8, r"config.mesh: .*product divides the 8 devices"),
    (["--config.rewards.min_anchors=5"], 1, r"config.rewards.min_anchors: 5, expected <= rollout.groups_per_step"),
    (["--config.rollout.group_size=1"], 1, r"config.rollout.group_size: 1, expected an int >= 2"),
    (["--config.optim.warmup_steps=50"], 1, r"config.optim.warmup_steps: 50, expected <= optim.total_steps = 20"),
    (["--config.rewards.target_weight=5.0"], 1, r"config.rewards.target_weight: 5.0, expected a number >= 1.0 "
                                                r"and <= 4.0"),
    (["--config.benchmark=mle_dojo"], 1, r"config.data_dir: '', expected the mle_dojo task folder"),
    (["--config.model_preset=qwen3.5-9b", "--config.model_path="], 1, r"config.model_path: '', expected the "
                                                                      r"qwen3.5-9b checkpoint folder"),
    (["--config.dtype=float16"], 1, r"config.dtype: 'float16', expected one of"),
    (["--config.agent.top_p=0.0"], 1, r"config.agent.top_p: 0.0"),
    (["--config.data_dir=/nonexistent/tasks"], 1, r"config.data_dir: '/nonexistent/tasks', expected an existing"),
])
def test_validate_names_the_field(model_dir, overrides, device_count, pattern):
    with pytest.raises(ValueError, match=pattern):
        validate(runnable("tiny_cpu", model_dir, *overrides), device_count=device_count)


def test_batch_layout_on_16_devices(model_dir):
    """9B: 64 sequences, fsdp 2 x tensor 4 on 16 devices -> data 2: 32 micro-batches of 2 cannot split
    data x fsdp = 4 ways, 16 of 4 can."""
    with pytest.raises(ValueError, match=r"micro-batches of 64 / 32 = 2 sequences divisible by the mesh's "
                                         r"data x fsdp = 2 x 2"):
        validate(runnable("mle_dojo_9b", model_dir), device_count=16)
    validate(runnable("mle_dojo_9b", model_dir, "--config.optim.micro_batches=16"), device_count=16)


@pytest.mark.parametrize("name,mesh,micro", [("mle_dojo_4b", (-1, 4, 2), 16), ("mle_dojo_9b", (-1, 2, 4), 32),
                                             ("dsbench_4b", (-1, 4, 2), 16), ("dsbench_9b", (-1, 2, 4), 32)])
def test_paper_configs_default_to_the_planners_fitting_layout(name, mesh, micro):
    """The layouts `launch/plan.py` shows fit 8 x 80 GB at the paper's caps (docs/scaling.md)."""
    c = load(name)
    assert (c.mesh.data, c.mesh.fsdp, c.mesh.tensor) == mesh and c.optim.micro_batches == micro


def test_empty_model_path_needs_the_built_micro_world(model_dir, monkeypatch):
    monkeypatch.setattr(micro_world, "shipped_path", lambda: model_dir / "not_built")
    with pytest.raises(ValueError, match=r"config.model_path: '', expected a built micro-world at .*not_built "
                                         r"\(python launch/build_micro_world.py\)"):
        validate(load("tiny_cpu"), device_count=1)
    monkeypatch.setattr(micro_world, "shipped_path", lambda: model_dir / "model")
    validate(load("tiny_cpu"), device_count=1)


def test_resolve_mesh():
    assert resolve_mesh({"data": -1, "fsdp": 8, "tensor": 1}, 16) == (2, 8, 1)
    assert resolve_mesh({"data": 2, "fsdp": 2, "tensor": 2}, 8) == (2, 2, 2)
    with pytest.raises(ValueError, match=r"config.mesh: .*at most one of them -1"):
        resolve_mesh({"data": -1, "fsdp": -1, "tensor": 1}, 8)
    with pytest.raises(ValueError, match=r"config.mesh: .*product is the 8 devices"):
        resolve_mesh({"data": 2, "fsdp": 2, "tensor": 1}, 8)


@pytest.mark.parametrize("value,policy", [("full", "full"), ("dots", "dots"), ("none", None)])
def test_remat_policy_from_the_command_line(model_dir, value, policy):
    from wmrl_jax.train.config import remat_policy

    config = runnable("tiny_cpu", model_dir, f"--config.optim.remat={value}")
    validate(config, device_count=1)
    assert remat_policy(config.optim.remat) == policy
    assert remat_policy(True) == "full" and remat_policy(False) is None   # Python callers may pass a bool
    with pytest.raises(ValueError, match=r"config.optim.remat: 'some', expected 'none', 'dots', 'full'"):
        remat_policy("some")
