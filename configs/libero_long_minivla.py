"""MiniVLA-style SFT on LIBERO-Long: a pretrained Qwen2.5-0.5B backbone, a ViT from scratch, two cameras.

    MUJOCO_GL=egl python launch/build_demos.py --tasks 0 2 4 5 6 7 8 --states 0-49 --out /tmp/wmrl/demos
    python launch/vla_sft.py --config configs/libero_long_minivla.py --backbone /path/to/Qwen2.5-0.5B
    MUJOCO_GL=egl python launch/vla_eval.py --checkpoint /tmp/wmrl/vla_minivla   # held-out states, per task

The paper's embodied track starts from MiniVLA-1B (Qwen2.5-0.5B behind a
DINO-SigLIP encoder, 224 px, OpenVLA's prompt and 256 action bins per
dimension). Here the backbone is the same Qwen2.5-0.5B checkpoint, read by
`wmrl_jax.models.load_hf` from an HF folder (weights and tokenizer; this
machine cannot download it, so `--backbone` names where it lies). The 256
action ids are the last rows of its padded embedding (151,936 rows for
151,665 tokenizer ids), so no row is added (`vla.sft.from_hf_backbone`). The
image encoder is the "small" preset's ViT from scratch (no pretrained vision
tower can be downloaded), at the demonstrations' frame size.

Keys are launch/vla_sft.py's flag names; any flag given on the command line
wins. None of these values was tuned on this machine (a 0.5B backbone does not
train on 2 CPU cores): they are a starting point for an accelerator, sized
from the demonstration set.
"""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.backbone = "/models/Qwen2.5-0.5B"   # an HF folder of Qwen/Qwen2.5-0.5B; --backbone overrides
    c.demos = "/tmp/wmrl/demos"           # launch/build_demos.py --out: the 7 tasks the scripted expert solves
    c.out = "/tmp/wmrl/vla_minivla"
    c.held_out_states = "40-49"           # 10 of each task's 50 initial states never train: vla_eval's default
    c.preset = "small"                    # the ViT: 8x8 patches, width 192, 4 layers
    c.cameras = ("agentview", "wrist")    # MiniVLA's two images (third-person and wrist)
    # 7 tasks x 40 states x ~270 recorded frames (the expert's mean steps) ~ 76k samples: 10k updates of 32
    # ~ 4 epochs. Full fine-tuning (no LoRA: MiniVLA's LoRA runs use 5e-4 on the adapters only) with a fresh
    # ViT and projector: 1e-4 peak, 500 warm-up updates, cosine to 1e-5.
    c.steps = 10_000
    c.batch = 32
    c.lr = 1e-4
    c.warmup = 500
    c.eval_every = 500
    c.save_every = 500
    return c
