"""The embedded micro-world: a tiny Qwen3.5 base model that writes solutions and predicts their outcomes.

On a laptop or in CI there is no Qwen checkpoint, so the project ships a base
model trained here, from the embedded task suite, that plays every role of the
paper: research agent, frozen reference and frozen world model. It is an
ordinary HF checkpoint folder (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with a ChatML template) loaded through the same code
path as a real Qwen3.5 checkpoint.

It learns from two corpora written from the suite's *train* split only (the
held-out tasks stay unseen):

* agent episodes -- the agent prompt of a train task, answered by one of its
  reference solutions (a one-line plan + the code, without the reference
  docstring), written so that every choice is made next to where it is used
  (`normalise_solution`): a model this small, trained for minutes, learns
  local dependencies but not yet the copy circuits a long-range one needs
  (two earlier builds wrote a train task's target name on every held-out
  task, and imported one model class while fitting another);
* world-model episodes -- the world-model prompt of a train task and a logged
  solution, answered with that solution's real logged outcome (status, error
  type, quality bucket of its leaderboard position).

The result is imperfect in the way WMRL needs: a small model that imitates a
few dozen solution templates writes runnable code of mixed quality, and as a
world model it is useful but biased -- it has seen mostly valid solutions and
only train tasks, so it over-rates code unlike its training data and mis-ranks
quality on held-out tasks.

Training is deterministic (fixed corpus order, fixed seed): the build log
records every step's loss so a rebuild can be checked step by step.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
from typing import Iterator, Sequence

import numpy as np

from wmrl_jax import agent, world_model

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BUILD_LOG = "build_log.json"


def shipped_path() -> pathlib.Path:
    """Where the built micro-world checkpoint ships inside the package."""
    return pathlib.Path(__file__).resolve().parent / "assets" / "micro_world"


@dataclasses.dataclass(frozen=True)
class MicroWorldConfig:
    """What the micro-world's prompts show and how big its model is.

    The prompt caps are smaller than the paper's (docs/design.md): a model of a
    few million parameters trains on ~1k-token sequences in minutes on 2 cores.
    """

    agent: agent.AgentConfig = agent.AgentConfig(
        max_turns=1, max_new_tokens=384, observation_max_tokens=96, overview_chars=900, inventory_chars=300,
        # 0.6: held-out valid rates 31/50/75/25 % (16 samples a task), against 19/31/38/6 % at 1.0.
        temperature=0.6, timeout_s=120.0)
    world_model: world_model.WorldModelConfig = world_model.WorldModelConfig(
        overview_chars=600, inventory_chars=200, code_chars=2400, max_new_tokens=48)
    vocab_size: int = 4096       # byte-level BPE trained on the corpus (Qwen3.5's own has 248k)
    hidden_size: int = 256
    intermediate_size: int = 768
    # Gated DeltaNet and gated attention alternate (the released models put one attention layer after
    # three DeltaNet ones): two attention layers let a tiny model form the copy circuit (previous-token +
    # induction) that writing a held-out task's target names needs; with one it had not after a 157-step build.
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    rope_theta: float = 10_000.0  # the released 1e7 serves 262k contexts; 1e4 resolves positions within ~1k tokens
    # Training. Small batches, many steps: conditioning on the prompt appears only after a few hundred
    # updates; 8 x 157 steps left the model writing one template for every task.
    seed: int = 0
    epochs: float = 1.25
    batch_size: int = 4
    learning_rate: float = 2e-3  # tiny models train well at a high peak rate; cosine decay to 10 %
    warmup_steps: int = 30
    prompt_loss_weight: float = 1.0  # prompt tokens are training text too (the cost of the forward is paid anyway)

    def model_config(self, vocab_size: int, eos_id: int, pad_id: int):
        """The Qwen3.5 (hybrid Gated DeltaNet + gated attention) config of the micro-world model."""
        from wmrl_jax.models import qwen35

        types = tuple(qwen35.FULL if i % 2 == 1 else qwen35.LINEAR for i in range(self.num_layers))
        return qwen35.Config(
            vocab_size=vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, layer_types=types,
            linear_num_key_heads=self.num_kv_heads, linear_num_value_heads=self.num_heads,
            linear_key_head_dim=self.head_dim, linear_value_head_dim=self.head_dim, tie_word_embeddings=True,
            rope_theta=self.rope_theta,
            max_position_embeddings=8192, eos_token_id=eos_id, pad_token_id=pad_id)


# --------------------------------------------------------------------------- corpora

_DOCSTRING = re.compile(r'\A\s*"""(?:.|\n)*?"""\s*\n')


def strip_docstring(code: str) -> str:
    """A reference solution without its leading docstring (which names the model it fits)."""
    return _DOCSTRING.sub("", code, count=1)


GENERIC_TARGETS = "TARGETS = [c for c in train.columns if c not in test.columns]"
_SKLEARN_IMPORT = re.compile(r"^(?:from sklearn[.\w]* import .*|import sklearn.*)\n", re.M)


def normalise_solution(code: str) -> str:
    """A reference solution in the agent corpus's form; its behaviour is unchanged.

    * no leading docstring (it names the model);
    * ``TARGETS = ['species']`` becomes the generic
      ``TARGETS = [c for c in train.columns if c not in test.columns]`` (the
      same list on every suite task: test.csv is train.csv without the targets);
    * the scikit-learn imports move to just above the ``model = ...`` line,
      so the class fitted is chosen right where it is imported.
    """
    code = strip_docstring(code).strip() + "\n"
    code = re.sub(r"^TARGETS = \[.*\]$", GENERIC_TARGETS, code, count=1, flags=re.M)
    imports = _SKLEARN_IMPORT.findall(code)
    if imports and re.search(r"^model = ", code, re.M):
        code = _SKLEARN_IMPORT.sub("", code)
        code = re.sub(r"^model = ", lambda m: "".join(imports) + m.group(0), code, count=1, flags=re.M)
    return code


def agent_reply(label: str, code: str) -> str:
    """What the agent is trained to answer: a one-line plan, then the program in a ```python block."""
    return f"Plan: fit {label} on the numeric features.\n```python\n{normalise_solution(code).strip()}\n```"


def world_model_answer(entry: dict) -> str:
    """The world model's target answer for a logged run (status, error type, quality bucket)."""
    bucket = world_model.quality_bucket(entry["position_score"]) if entry["status"] == "valid" else None
    return world_model.format_answer(entry["status"], error=entry.get("error_type"), bucket=bucket)


def corpora(config: MicroWorldConfig, split: str = "train", root=None) -> tuple[list, list]:
    """(agent episodes, world-model episodes) as (task name, messages, reply), from the suite's `split`.

    Agent episodes use the valid reference solutions; world-model episodes use
    every logged run the world model could be asked about (the gate decides
    malformed and syntax errors, so those are left out).
    """
    import sandbox
    from sandbox import suite

    tasks = {p.name: sandbox.load_task(p) for p in suite.list_tasks(split, root)}
    log = suite.execution_log(split, root)
    agent_eps, wm_eps = [], []
    for entry in log:
        task = tasks[entry["task"]]
        if entry["origin"] == "reference" and entry["status"] == "valid":
            agent_eps.append((task.name, agent.initial_messages(task, config.agent), agent_reply(entry["label"], entry["code"])))
        if world_model.gate(entry["code"]) is None:
            wm_eps.append((task.name, world_model.messages(task, entry["code"], config.world_model), world_model_answer(entry)))
    return agent_eps, wm_eps


def render(messages: Sequence[dict], reply: str) -> tuple[str, str]:
    """(prompt text up to the assistant header, reply text with its end-of-turn) under the ChatML template."""
    prompt = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"
    return prompt, reply + "<|im_end|>"


# --------------------------------------------------------------------------- tokenizer

def train_tokenizer(texts: Iterator[str], vocab_size: int):
    """A byte-level BPE trained on `texts`, with ChatML specials and template, as a transformers tokenizer.

    Byte-level so that any text (including code the model invents) encodes;
    GPT-2's pre-split (words, punctuation runs, spaces), so an identifier is
    cut into the same pieces wherever it stands: ``id,pct_above_median`` in a
    submission header and ``['pct_above_median']`` in code share their
    tokens, which is what lets the model copy an unseen target name. (Letting
    merges cross spaces halves the sequences but makes whole lines such as
    ``TARGETS = ['species']`` single tokens that cannot be copied.)
    """
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)


def training_examples(config: MicroWorldConfig, root=None) -> list:
    """[(prompt text, reply text, kind)] of both corpora, agent episodes first (the batch order is seeded)."""
    agent_eps, wm_eps = corpora(config, "train", root)
    return [(*render(messages, reply), kind)
            for kind, episodes in (("agent", agent_eps), ("world_model", wm_eps)) for _, messages, reply in episodes]



# --------------------------------------------------------------------------- training

def encode_examples(tokenizer, examples: Sequence) -> list[tuple[np.ndarray, np.ndarray]]:
    """[(ids int32[T], is_reply bool[T])]: the prompt and the reply encoded apart, as they are at sampling time."""
    out = []
    for prompt, reply, _ in examples:
        p = tokenizer.encode(prompt, add_special_tokens=False)
        r = tokenizer.encode(reply, add_special_tokens=False)
        out.append((np.asarray(p + r, np.int32), np.asarray([False] * len(p) + [True] * len(r), bool)))
    return out


def batches(encoded: Sequence, *, batch_size: int, steps: int, width: int, pad_id: int, seed: int):
    """`steps` left-padded batches (tokens int32[B, W], valid, is_reply), epoch by epoch in a seeded order."""
    rng = np.random.default_rng(seed)
    order: list[int] = []
    for _ in range(steps):
        while len(order) < batch_size:
            order += rng.permutation(len(encoded)).tolist()
        rows, order = order[:batch_size], order[batch_size:]
        tokens = np.full((batch_size, width), pad_id, np.int32)
        valid = np.zeros((batch_size, width), bool)
        reply = np.zeros((batch_size, width), bool)
        for i, r in enumerate(rows):
            ids, is_reply = encoded[r]
            tokens[i, width - len(ids):] = ids
            valid[i, width - len(ids):] = True
            reply[i, width - len(ids):] = is_reply
        yield tokens, valid, reply


def make_train_step(model_config, optimizer, prompt_loss_weight: float):
    """A jitted step: masked next-token cross-entropy (reply tokens, plus prompt tokens at a small weight)."""
    import jax
    import jax.numpy as jnp
    import optax

    from wmrl_jax.logprobs import token_logprobs
    from wmrl_jax.models import qwen35

    def loss_fn(params, tokens, valid, reply):
        logp, _ = token_logprobs(params, model_config, qwen35, tokens, valid)
        scored = valid & jnp.pad(valid[:, :-1], ((0, 0), (1, 0)))
        is_reply = scored & reply
        is_prompt = scored & ~reply
        reply_nll = -jnp.sum(jnp.where(is_reply, logp, 0.0)) / jnp.maximum(is_reply.sum(), 1)
        prompt_nll = -jnp.sum(jnp.where(is_prompt, logp, 0.0)) / jnp.maximum(is_prompt.sum(), 1)
        return reply_nll + prompt_loss_weight * prompt_nll, (reply_nll, prompt_nll)

    @jax.jit
    def step(params, opt_state, tokens, valid, reply):
        (_, (reply_nll, prompt_nll)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens, valid, reply)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, reply_nll, prompt_nll

    return step


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def build(out_dir, config: MicroWorldConfig = MicroWorldConfig(), *, steps: int | None = None,
          progress: bool = True, root=None) -> dict:
    """Builds the micro-world checkpoint into `out_dir`; returns the build log (also written as build_log.json).

    Deterministic for a given config and suite: corpus order, tokenizer,
    initialisation and batch order all follow `config.seed`. `steps` stops
    early without changing the schedule, so the first steps of a short build
    equal those of the full one (how a rebuild is checked against the log).
    """
    import time

    import jax
    import jax.numpy as jnp
    import optax
    from tqdm.auto import tqdm

    from wmrl_jax.models import qwen35, save_hf
    from wmrl_jax.models.family import Model

    start = time.perf_counter()
    out_dir = pathlib.Path(out_dir)
    examples = training_examples(config, root=root)
    tokenizer = train_tokenizer((p + r for p, r, _ in examples), config.vocab_size)
    eos_id, pad_id = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model_config = config.model_config(len(tokenizer), eos_id, pad_id)
    encoded = encode_examples(tokenizer, examples)
    width = -(-max(len(ids) for ids, _ in encoded) // 64) * 64
    planned = int(np.ceil(config.epochs * len(encoded) / config.batch_size))
    total = planned if steps is None else min(int(steps), planned)
    schedule = optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, config.warmup_steps, planned,
                                                  end_value=0.1 * config.learning_rate)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=0.01))
    params = jax.jit(lambda key: qwen35.init_params(model_config, key, jnp.float32))(jax.random.key(config.seed))
    opt_state = optimizer.init(params)
    step = make_train_step(model_config, optimizer, config.prompt_loss_weight)
    reply_losses, prompt_losses = [], []
    bar = tqdm(batches(encoded, batch_size=config.batch_size, steps=total, width=width, pad_id=pad_id,
                       seed=config.seed), total=total, desc="micro-world", disable=not progress)
    for tokens, valid, reply in bar:
        params, opt_state, reply_nll, prompt_nll = step(params, opt_state, tokens, valid, reply)
        reply_losses.append(float(reply_nll))
        prompt_losses.append(float(prompt_nll))
        bar.set_postfix(reply_nll=f"{reply_losses[-1]:.3f}", prompt_nll=f"{prompt_losses[-1]:.3f}")
    train_s = time.perf_counter() - start

    # bf16 halves the shipped folder (the loop loads it back in float32).
    model = Model(config=model_config, params=jax.tree.map(lambda x: x.astype(jnp.bfloat16), params), family=qwen35)
    save_hf(model, out_dir, tokenizer=tokenizer)
    counts = {kind: sum(k == kind for *_, k in examples) for kind in ("agent", "world_model")}
    log = {
        "seed": config.seed, "steps": total, "planned_steps": planned, "batch_size": config.batch_size, "width": width,
        "examples": counts, "tokens_per_step": int(config.batch_size * width),
        "parameters": int(sum(x.size for x in jax.tree.leaves(params))),
        "reply_nll": reply_losses, "prompt_nll": prompt_losses,
        "seconds": round(time.perf_counter() - start, 1), "train_seconds": round(train_s, 1),
        "cpu": _cpu_name(), "jax": jax.__version__, "config": repr(config),
    }
    (out_dir / BUILD_LOG).write_text(json.dumps(log, indent=1) + "\n")
    return log
