"""Run configs (big_vision style): each file's `get_config()` returns an `ml_collections.ConfigDict`.

    python launch/train.py --config=configs/tiny_cpu.py --config.rewards.mode=real

`base.py` holds the paper's hyper-parameters; the others override what differs.
"""
