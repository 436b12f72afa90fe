"""Builds the execution corpus the micro-world's world model learns from (train tasks only).

    python launch/build_wm_corpus.py                         # into sandbox/suite/embedded (what ships)
    python launch/build_wm_corpus.py --out /tmp/corpus.jsonl.gz --agent_samples_per_task=0

Mutants of the reference programs and the base agent's own samples, each run
in the real sandbox; its label is that run's outcome (`wmrl_jax.execution_corpus`).
About 20-25 minutes on 2 cores, most of it sandbox runs. Resumable: killed and
started again with the same flags, it continues from `<out>.partial`; nothing
is written under `--out` until every program has run.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from absl import app, flags

import bench_common  # noqa: F401  (importing it quiets absl/JAX INFO logs)

# Runnable as `python launch/build_wm_corpus.py` from a checkout without installing.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from wmrl_jax import execution_corpus  # noqa: E402

_DEFAULTS = execution_corpus.CorpusConfig()
_OUT = flags.DEFINE_string("out", None, "Corpus file to write (default: the shipped one beside the suite).")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Agent whose samples join the corpus (default: the shipped "
                                                      "micro-world).")
_AGENT = flags.DEFINE_integer("agent_samples_per_task", _DEFAULTS.agent_samples_per_task,
                              "The agent's own programs per train task (0: none, no model is loaded).")
_SEED = flags.DEFINE_integer("seed", _DEFAULTS.seed, "Seed of the mutation plan and of the agent's sampling.")
_WORKERS = flags.DEFINE_integer("workers", 2, "Concurrent sandboxes.")
_REUSE = flags.DEFINE_bool("reuse", True, "Keep the labels of programs already in the corpus at --out (same suite, "
                                          "same time limit) and run only the new ones; --noreuse runs everything.")


def main(argv):
    del argv
    import sandbox
    from sandbox import suite

    config = dataclasses.replace(_DEFAULTS, seed=_SEED.value, agent_samples_per_task=_AGENT.value)
    entries = execution_corpus.plan(config)
    if config.agent_samples_per_task:
        from wmrl_jax import chat, fidelity, micro_world

        lm = chat.load_chat_model(_CHECKPOINT.value or micro_world.shipped_path())
        tasks = [sandbox.load_task(p) for p in suite.list_tasks("train")]
        codes = fidelity.sample_solutions(lm, tasks, config.agent_samples_per_task,
                                          config=micro_world.MicroWorldConfig().agent, seed=config.seed)
        known = {e["key"] for e in entries}
        for entry in execution_corpus.agent_entries(tasks, codes):
            if entry["key"] not in known:   # the same program sampled twice is run once
                known.add(entry["key"])
                entries.append(entry)
    out = _OUT.value or execution_corpus.corpus_path()
    previous = execution_corpus.reusable(out, config) if _REUSE.value else {}
    rows = execution_corpus.execute(entries, out, config=config, workers=_WORKERS.value, previous=previous)
    from collections import Counter

    print(f"execution corpus: {len(rows)} programs -> {out}")
    for origin in ("mutant", "agent"):
        counts = Counter(r["status"] for r in rows if r["origin"] == origin)
        print(f"  {origin}: {dict(sorted(counts.items()))}")


if __name__ == "__main__":
    app.run(main)
