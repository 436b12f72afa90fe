"""Host-side sandbox: isolated execution, grading, task formats. No JAX here."""
