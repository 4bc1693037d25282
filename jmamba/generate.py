"""`generate`: prefill the prompt once, then a jitted single-token decode loop on the carried state.

Without `stream`, the whole generation (prefill, decode loop, stopping) is one `jax.jit` program: a
`lax.scan` over the new tokens (a `lax.while_loop` that ends when every row has stopped, when EOS ids
or stop sequences are given), so there is no retrace and no host round trip per token. With
`stream`, a host loop runs one jitted decode step per token and calls the callback with the previous
token while the device computes the next one.

Ragged prompts are left-padded and the recurrent state is reset at each row's first real token
(`reset` mask), which is exactly the same as running the row alone (docs/generation.md §2). With
`bucket=True` the padded prompt length is the next power of two, so prompts of new lengths reuse
the compiled programs of their bucket (§3). Compiled programs are cached per (model structure,
batch, padded prompt length, max_new_tokens, number and length of stop sequences, sampling
settings, precision).
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmamba.backbone import take_compute_dtype
from jmamba.core.precision import as_precision
from jmamba.core.validation import shape_of
from jmamba.sampling import check_sampling_args, sample_next


def generate(lm, prompt_ids, max_new_tokens: int, *, temperature: float = 0.0, top_k=None, top_p=None,
             rng=None, precision=None, prompt_lengths=None, eos_token_id=None, pad_token_id: int = 0,
             stop_sequences=None, stream=None, bucket: bool = True, return_lengths: bool = False,
             **deprecated):
    """Continues each prompt row.

    Args:
      lm: a `MambaLM`.
      prompt_ids: [B, P] int token ids (P >= 1), or a list of B lists of ids (ragged: lengths may
        differ). With `prompt_lengths`, row b's prompt is `prompt_ids[b, :prompt_lengths[b]]`
        (right-padded; the ids past a row's length are ignored).
      max_new_tokens: number of tokens to add (>= 0).
      temperature: 0 = greedy; > 0 samples.
      top_k, top_p: optional filters for sampling.
      rng: a `jax.random` key (required when temperature > 0).
      precision: compute precision of the model ("f32" default, "bf16", "f16"; `compute_dtype=` is
        its deprecated name).
      prompt_lengths: optional [B] ints in [1, P]: the length of each row of a right-padded
        `prompt_ids` (not with a list of lists, whose lengths are its own).
      eos_token_id: None, an id or a list of ids: a row stops after emitting one of them (it is kept
        in the output).
      pad_token_id: fills the positions after a row's last token (default 0; any int, e.g. -1: it is
        never fed to the model).
      stop_sequences: None or a list of token-id lists: a row stops after its generated tokens end
        with one of them (kept in the output). Only generated tokens count, not the prompt.
      stream: None or a callable `stream(step_index, tokens, done)`, called once per generated
        position in order, as the tokens are produced: `tokens` [B] numpy int32 is the token of
        every row at this position (`pad_token_id` for a row that stopped earlier), `done` [B]
        numpy bool says which rows have stopped (at this token or before). Calls end after
        `max_new_tokens` positions or once every row has stopped.
      bucket: pad the prompt length to the next power of two (left padding with a state reset: the
        results do not change beyond float rounding), so that new prompt lengths reuse compiled
        programs. `bucket=False` pads ragged prompts only to the longest one and runs equal-length
        prompts exactly as given.
      return_lengths: also return each row's length in the output.

    Returns:
      [B, P + max_new_tokens] int32 (P = the longest prompt): row b is its prompt, then its new
      tokens, then `pad_token_id` up to the end (after an EOS / stop sequence, and after a short
      prompt). For equal-length prompts without stopping this is the prompt followed by
      `max_new_tokens` new tokens. With `return_lengths=True`, `(ids, lengths)` where `lengths` [B]
      int32 counts the prompt and generated tokens of each row (`ids[b, :lengths[b]]`).
    """
    precision = as_precision(take_compute_dtype(deprecated, precision, "generate"))
    vocab = lm.config.vocab_size
    prompts, lengths, given_array = _normalize_prompts(prompt_ids, prompt_lengths, vocab)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    check_sampling_args(temperature, top_k, top_p, vocab)
    if temperature > 0 and rng is None:
        raise ValueError("rng (a jax.random key) is required when temperature > 0")
    stops, stop_mask = _stop_table(eos_token_id, stop_sequences, vocab)
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, numbers.Integral) or not (
            -2 ** 31 <= pad_token_id < 2 ** 31):
        raise TypeError(f"pad_token_id must be an int (int32), got {pad_token_id!r}")
    if stream is not None and not callable(stream):
        raise TypeError(f"stream must be None or a callable stream(step_index, tokens, done), "
                        f"got {type(stream).__name__}")
    for name, flag in (("bucket", bucket), ("return_lengths", return_lengths)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")

    bsz, width = prompts.shape
    longest = int(lengths.max())
    equal = bool(np.all(lengths == width))
    if max_new_tokens == 0:
        out = given_array if equal and given_array is not None else _assemble(prompts, lengths, None, pad_token_id)
        return (out, jnp.asarray(lengths)) if return_lengths else out

    # Left-pad to the bucket; the reset at each row's first real token makes the padding invisible.
    padded_len = _bucket(longest) if bucket else longest
    if np.all(lengths == padded_len):                    # no padding: today's program exactly
        ids, reset = (given_array if equal and given_array is not None else jnp.asarray(prompts[:, :padded_len])), None
    else:
        start = padded_len - lengths                     # first real position of each row
        pos = np.arange(padded_len)[None]
        src = np.clip(pos - start[:, None], 0, width - 1)
        ids = jnp.asarray(np.where(pos >= start[:, None], np.take_along_axis(prompts, src, 1), 0), jnp.int32)
        reset = jnp.asarray(pos == start[:, None])
    rng = jax.random.PRNGKey(0) if rng is None else rng
    settings = (max_new_tokens, float(temperature), top_k, None if top_p is None else float(top_p), precision)
    graphdef, params = nnx.split(lm)
    pad = jnp.int32(pad_token_id)

    if stream is not None:
        new, n_new = _stream_loop(graphdef, params, ids, reset, rng, stops, stop_mask, pad, settings, stream)
    elif stops is None:
        new = _decode(graphdef, params, ids, reset, rng, *settings)
        n_new = None
    else:
        new, n_new = _decode_until(graphdef, params, ids, reset, rng, stops, stop_mask, pad, *settings)

    if equal and given_array is not None:
        out = jnp.concatenate([given_array, new], axis=1)
    else:
        out = _assemble(prompts, lengths, np.asarray(new), pad_token_id)
    if not return_lengths:
        return out
    n_new = np.full((bsz,), max_new_tokens, np.int32) if n_new is None else np.asarray(n_new, np.int32)
    return out, jnp.asarray(lengths + n_new, jnp.int32)


# ------------------------------------------------------------------------------------ arguments
def _normalize_prompts(prompt_ids, prompt_lengths, vocab):
    """-> (prompts [B, W] int32 numpy right-padded with 0, lengths [B] int32 numpy, the int32 device
    array of prompt_ids when it was given as an array without padding, else None)."""
    if isinstance(prompt_ids, (list, tuple)) and len(prompt_ids) and all(
            isinstance(r, (list, tuple, np.ndarray, jax.Array)) for r in prompt_ids):
        if prompt_lengths is not None:
            raise ValueError("prompt_lengths must be None when prompt_ids is a list of token lists "
                             "(the lists carry their own lengths)")
        rows = []
        for b, r in enumerate(prompt_ids):
            a = np.asarray(r)
            if a.ndim != 1 or a.size == 0 or a.dtype == bool or not np.issubdtype(a.dtype, np.integer):
                raise ValueError(f"prompt_ids[{b}] must be a non-empty list of int token ids, got {r!r:.80}")
            rows.append(a.astype(np.int64))
        lengths = np.array([len(r) for r in rows], np.int32)
        prompts = np.zeros((len(rows), int(lengths.max())), np.int64)
        for b, r in enumerate(rows):
            prompts[b, :len(r)] = r
        given = jnp.asarray(prompts, jnp.int32) if np.all(lengths == prompts.shape[1]) else None
    else:
        s = shape_of(prompt_ids)
        if len(s) != 2 or s[1] < 1 or s[0] < 1 or not jnp.issubdtype(jnp.result_type(prompt_ids), jnp.integer):
            raise ValueError(f"prompt_ids must be an integer array [batch, prompt_len >= 1] or a list of "
                             f"token-id lists, got shape {s}")
        given = jnp.asarray(prompt_ids, jnp.int32)
        prompts = np.asarray(prompt_ids).astype(np.int64)
        if prompt_lengths is None:
            lengths = np.full((s[0],), s[1], np.int32)
        else:
            lengths = _check_lengths(prompt_lengths, s)
            if not np.all(lengths == s[1]):
                given = None
    real = np.arange(prompts.shape[1])[None] < lengths[:, None]
    bad = np.argwhere(real & ((prompts < 0) | (prompts >= vocab)))
    if len(bad):
        pos = tuple(int(i) for i in bad[0])
        raise ValueError(f"prompt_ids must lie in [0, {vocab}): prompt_ids{list(pos)} = {int(prompts[pos])} "
                         f"({len(bad)} such ids)")
    return np.where(real, prompts, 0).astype(np.int32), lengths, given


def _check_lengths(prompt_lengths, shape):
    if isinstance(prompt_lengths, jax.core.Tracer):
        raise TypeError("prompt_lengths must be concrete (numpy, a list or a jax array outside jit)")
    a = np.asarray(prompt_lengths)
    if a.dtype == bool or not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"prompt_lengths must hold ints, got dtype {a.dtype}")
    if a.shape != (shape[0],):
        raise ValueError(f"prompt_lengths must have shape [batch] = ({shape[0]},), got {a.shape}")
    bad = np.flatnonzero((a < 1) | (a > shape[1]))
    if len(bad):
        raise ValueError(f"prompt_lengths must lie in [1, prompt_ids.shape[1] = {shape[1]}]: "
                         f"prompt_lengths[{bad[0]}] = {int(a[bad[0]])}")
    return a.astype(np.int32)


def _token_list(name, value, vocab):
    """A list of ints in [0, vocab) from an int or a sequence of ints (TypeError / ValueError naming `name`)."""
    items = [value] if isinstance(value, numbers.Integral) else value
    if isinstance(items, (str, bytes)) or not hasattr(items, "__iter__"):
        raise TypeError(f"{name} must be an int or a list of ints, got {type(value).__name__}")
    items = list(items)
    for x in items:
        if isinstance(x, bool) or not isinstance(x, numbers.Integral):
            raise TypeError(f"{name} must hold int token ids, got {x!r}")
        if not 0 <= x < vocab:
            raise ValueError(f"{name}: {int(x)} is not a token id in [0, {vocab})")
    return [int(x) for x in items]


def _stop_table(eos_token_id, stop_sequences, vocab):
    """EOS ids (as one-token sequences) and stop sequences -> (stops [S, M] int32 left-padded with -1,
    mask [S, M] bool, True on real positions), or (None, None) when nothing stops a row."""
    seqs = []
    if eos_token_id is not None:
        ids = _token_list("eos_token_id", eos_token_id, vocab)
        if not ids:
            raise ValueError("eos_token_id must not be an empty list (use None)")
        seqs += [[i] for i in ids]
    if stop_sequences is not None:
        if isinstance(stop_sequences, (str, bytes)) or not hasattr(stop_sequences, "__iter__"):
            raise TypeError(f"stop_sequences must be a list of token-id lists, got {type(stop_sequences).__name__}")
        for j, s in enumerate(stop_sequences):
            if isinstance(s, numbers.Integral):
                raise TypeError(f"stop_sequences must be a list of token-id lists (stop_sequences[{j}] is an "
                                f"int; for single tokens use [[id], ...] or eos_token_id)")
            s = _token_list(f"stop_sequences[{j}]", s, vocab)
            if not s:
                raise ValueError(f"stop_sequences[{j}] must not be empty")
            seqs.append(s)
    if not seqs:
        return None, None
    width = max(len(s) for s in seqs)
    stops = np.full((len(seqs), width), -1, np.int32)
    for j, s in enumerate(seqs):
        stops[j, width - len(s):] = s
    return jnp.asarray(stops), jnp.asarray(stops >= 0)


def _bucket(n: int) -> int:
    """The power of two >= n (1, 2, 4, 8, ...)."""
    return 1 << (n - 1).bit_length()


def _assemble(prompts, lengths, new, pad):
    """Row b = prompt_b, then new[b], then pad; [B, max(lengths) + N] int32."""
    bsz = prompts.shape[0]
    n = 0 if new is None else new.shape[1]
    out = np.full((bsz, int(lengths.max()) + n), pad, np.int64)
    for b in range(bsz):
        out[b, :lengths[b]] = prompts[b, :lengths[b]]
        if n:
            out[b, lengths[b]:lengths[b] + n] = new[b]
    return jnp.asarray(out.astype(np.int32))


# ------------------------------------------------------------------------------------ programs
def _sampler(temperature, top_k, top_p):
    return functools.partial(sample_next, temperature=temperature, top_k=top_k, top_p=top_p)


def _prefill(lm, ids, reset, key, sample, precision):
    logits, state = lm(ids, reset=reset, precision=precision)
    return sample(logits[:, -1], key), state


def _track(tok, done, hist, stops, stop_mask, pad):
    """Emits `tok` (pad for rows already done); a row is done once its last generated tokens `hist`
    end with a stop sequence. -> (emitted [B], done [B], hist [B, M])."""
    emitted = jnp.where(done, pad, tok)
    hist = jnp.concatenate([hist[:, 1:], tok[:, None]], axis=1)
    hit = jnp.any(jnp.all((hist[:, None, :] == stops[None]) | ~stop_mask[None], axis=-1), axis=-1)
    return emitted, done | hit, hist


@functools.partial(jax.jit, static_argnums=(0, 5, 6, 7, 8, 9))
def _decode(graphdef, params, prompt_ids, reset, rng, max_new_tokens, temperature, top_k, top_p, precision):
    """No stopping: prefill, then a `lax.scan` of max_new_tokens - 1 steps -> new tokens [B, N]."""
    lm = nnx.merge(graphdef, params)
    sample = _sampler(temperature, top_k, top_p)
    keys = jax.random.split(rng, max_new_tokens)
    first, state = _prefill(lm, prompt_ids, reset, keys[0], sample, precision)

    def body(carry, key):
        tok, st = carry
        step_logits, st = lm.step(tok, st, precision=precision)
        nxt = sample(step_logits, key)
        return (nxt, st), tok

    (last, _), toks = jax.lax.scan(body, (first, state), keys[1:])
    return jnp.concatenate([toks.T, last[:, None]], axis=1)


@functools.partial(jax.jit, static_argnums=(0, 8, 9, 10, 11, 12))
def _decode_until(graphdef, params, prompt_ids, reset, rng, stops, stop_mask, pad, max_new_tokens, temperature,
                  top_k, top_p, precision):
    """With stopping: a `lax.while_loop` that ends when every row is done -> (new [B, N], counts [B])."""
    lm = nnx.merge(graphdef, params)
    sample = _sampler(temperature, top_k, top_p)
    keys = jax.random.split(rng, max_new_tokens)
    bsz = prompt_ids.shape[0]
    tok, state = _prefill(lm, prompt_ids, reset, keys[0], sample, precision)
    hist = jnp.full((bsz, stops.shape[1]), -1, jnp.int32)
    emitted, done, hist = _track(tok, jnp.zeros((bsz,), bool), hist, stops, stop_mask, pad)
    out = jnp.full((bsz, max_new_tokens), pad, jnp.int32).at[:, 0].set(emitted)
    count = jnp.ones((bsz,), jnp.int32)

    def cond(c):
        return (c[0] < max_new_tokens) & ~jnp.all(c[3])

    def body(c):
        i, tok, st, done, hist, out, count = c
        step_logits, st = lm.step(tok, st, precision=precision)
        nxt = sample(step_logits, keys[i])
        count = count + (~done).astype(jnp.int32)
        emitted, done, hist = _track(nxt, done, hist, stops, stop_mask, pad)
        out = jax.lax.dynamic_update_slice(out, emitted[:, None], (0, i))
        return i + 1, nxt, st, done, hist, out, count

    c = jax.lax.while_loop(cond, body, (jnp.int32(1), tok, state, done, hist, out, count))
    return c[5], c[6]


@functools.partial(jax.jit, static_argnums=(0, 8, 9, 10, 11))
def _stream_first(graphdef, params, prompt_ids, reset, key, stops, stop_mask, pad, temperature, top_k, top_p,
                  precision):
    lm = nnx.merge(graphdef, params)
    tok, state = _prefill(lm, prompt_ids, reset, key, _sampler(temperature, top_k, top_p), precision)
    bsz = prompt_ids.shape[0]
    hist = jnp.full((bsz, stops.shape[1]), -1, jnp.int32)
    emitted, done, hist = _track(tok, jnp.zeros((bsz,), bool), hist, stops, stop_mask, pad)
    return emitted, (tok, state, done, hist)


@functools.partial(jax.jit, static_argnums=(0, 7, 8, 9, 10))
def _stream_next(graphdef, params, carry, key, stops, stop_mask, pad, temperature, top_k, top_p, precision):
    lm = nnx.merge(graphdef, params)
    tok, state, done, hist = carry
    step_logits, state = lm.step(tok, state, precision=precision)
    nxt = _sampler(temperature, top_k, top_p)(step_logits, key)
    emitted, done, hist = _track(nxt, done, hist, stops, stop_mask, pad)
    return emitted, (nxt, state, done, hist)


def _stream_loop(graphdef, params, ids, reset, rng, stops, stop_mask, pad, settings, stream):
    """One jitted step per token. Step i+1 is dispatched before the host waits for token i, so the
    callback runs while the device computes the next token. -> (new [B, N] numpy, counts [B])."""
    max_new_tokens, temperature, top_k, top_p, precision = settings
    if stops is None:   # nothing stops a row: one stop that never matches (no token id, nor hist's -1)
        stops, stop_mask = jnp.full((1, 1), -2, jnp.int32), jnp.ones((1, 1), bool)
    sampling = (temperature, top_k, top_p, precision)
    keys = jax.random.split(rng, max_new_tokens)
    bsz = ids.shape[0]
    new = np.full((bsz, max_new_tokens), int(pad), np.int32)
    count = np.zeros((bsz,), np.int32)
    done_before = np.zeros((bsz,), bool)
    emitted, carry = _stream_first(graphdef, params, ids, reset, keys[0], stops, stop_mask, pad, *sampling)
    for i in range(max_new_tokens):
        ahead = (_stream_next(graphdef, params, carry, keys[i + 1], stops, stop_mask, pad, *sampling)
                 if i + 1 < max_new_tokens else None)           # dispatched, not waited for
        tokens, done = np.asarray(emitted), np.asarray(carry[2])  # waits for token i only
        new[:, i] = tokens
        count += ~done_before
        stream(i, tokens, done)
        if ahead is None or done.all():
            break
        done_before = done
        emitted, carry = ahead
    return new, count
