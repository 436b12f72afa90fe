"""wmrl-jax: World Model RL for LLM research agents, in JAX.

Light on purpose: importing the package pulls in nothing heavy, so
`import wmrl_jax.losses` / `import wmrl_jax.corrections` need only jax/chex/numpy.
"""

__version__ = "0.1.0"
