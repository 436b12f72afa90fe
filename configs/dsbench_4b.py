"""WMRL, Qwen3.5-4B on DSBench, the paper's recipe (configs/base.py), 8 GPUs.

    python launch/train.py --config=configs/dsbench_4b.py \
        --config.model_path=/ckpt/Qwen3.5-4B --config.data_dir=/data/dsbench --config.workdir=/runs/dsbench_4b

Cost (the paper's figure for this model size, A100s): ~286 GPU-hours for WMRL vs ~883 for GRPO with every
rollout executed. Arms: --config.rewards.mode=real|wm_only|naive_mix|debias_only|denoise_only.
"""

from configs import base


def get_config():
    return base.get_paper_config("qwen3.5-4b", "dsbench")
