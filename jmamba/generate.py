"""`generate`: prefill the prompt once, then a jitted single-token decode loop on the carried state.

The decode loop is one `lax.scan` inside one `jax.jit`, so no retrace per token; compiled programs
are cached per (model structure, prompt shape, max_new_tokens, sampling settings).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jmamba.backbone import take_compute_dtype
from jmamba.core.precision import as_precision
from jmamba.core.validation import shape_of
from jmamba.sampling import check_sampling_args, sample_next


def generate(lm, prompt_ids, max_new_tokens: int, *, temperature: float = 0.0, top_k=None, top_p=None,
             rng=None, precision=None, **deprecated):
    """Continues each prompt row.

    Args:
      lm: a `MambaLM`.
      prompt_ids: [B, P] int token ids (P >= 1; every row has the same length, no padding).
      max_new_tokens: number of tokens to add (>= 0).
      temperature: 0 = greedy; > 0 samples.
      top_k, top_p: optional filters for sampling.
      rng: a `jax.random` key (required when temperature > 0).
      precision: compute precision of the model ("f32" default, "bf16", "f16"; `compute_dtype=` is
        its deprecated name).

    Returns:
      [B, P + max_new_tokens] int32: the prompt followed by the new tokens.
    """
    precision = as_precision(take_compute_dtype(deprecated, precision, "generate"))
    s = shape_of(prompt_ids)
    if len(s) != 2 or s[1] < 1 or not jnp.issubdtype(jnp.result_type(prompt_ids), jnp.integer):
        raise ValueError(f"prompt_ids must be an integer array [batch, prompt_len >= 1], got shape {s}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    vocab = lm.config.vocab_size
    check_sampling_args(temperature, top_k, top_p, vocab)
    prompt_ids = jnp.asarray(prompt_ids, jnp.int32)
    if bool(jnp.any((prompt_ids < 0) | (prompt_ids >= vocab))):
        raise ValueError(f"prompt_ids must lie in [0, {vocab})")
    if temperature > 0 and rng is None:
        raise ValueError("rng (a jax.random key) is required when temperature > 0")
    if max_new_tokens == 0:
        return prompt_ids
    rng = jax.random.PRNGKey(0) if rng is None else rng
    graphdef, params = nnx.split(lm)
    new = _decode(graphdef, params, prompt_ids, rng, max_new_tokens, float(temperature), top_k,
                  None if top_p is None else float(top_p), precision)
    return jnp.concatenate([prompt_ids, new], axis=1)


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6, 7, 8))
def _decode(graphdef, params, prompt_ids, rng, max_new_tokens, temperature, top_k, top_p, precision):
    lm = nnx.merge(graphdef, params)
    logits, state = lm(prompt_ids, precision=precision)
    sample = functools.partial(sample_next, temperature=temperature, top_k=top_k, top_p=top_p)
    keys = jax.random.split(rng, max_new_tokens)
    first = sample(logits[:, -1], keys[0])

    def body(carry, key):
        tok, st = carry
        step_logits, st = lm.step(tok, st, precision=precision)
        nxt = sample(step_logits, key)
        return (nxt, st), tok

    (last, _), toks = jax.lax.scan(body, (first, state), keys[1:])
    return jnp.concatenate([toks.T, last[:, None]], axis=1)
