"""Training: the jitted GRPO update (`update`), run checkpoints (`checkpoint`), configs (`config`), the host loop (`loop`).

Submodules are imported on use (`from wmrl_jax.train import update`), so that
importing the package pulls in neither Orbax nor the sandbox.
"""
