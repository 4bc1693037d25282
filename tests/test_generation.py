"""generate: ragged prompts (left padding + state reset), prompt-length buckets, EOS / stop sequences,
streaming, argument errors, and the `python -m jmamba.sample` command."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jmamba import Mamba1Config, Mamba3Config, MambaLM, generate
from jmamba import ops

gen_module = sys.modules["jmamba.generate"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V = 13
CFGS = {"mamba1": Mamba1Config(d_model=8, n_layers=2, d_state=4, d_conv=3),
        "mamba3": Mamba3Config(d_model=16, n_layers=2, d_state=8, headdim=8)}


@pytest.fixture(scope="module", params=sorted(CFGS))
def lm(request):
    with ops.tuning("mamba3_siso_scan", chunk_size=4):   # chunks shorter than the prompts: resets cross chunks
        yield MambaLM(CFGS[request.param], V, rngs=nnx.Rngs(3))


@pytest.fixture(scope="module", params=sorted(CFGS))
def lm1(request):
    """One layer: the stopping and streaming tests need no depth (and compile twice as fast)."""
    with ops.tuning("mamba3_siso_scan", chunk_size=4):
        yield MambaLM(dataclasses.replace(CFGS[request.param], n_layers=1), V, rngs=nnx.Rngs(4))


def _rows(seed=0, lengths=(3, 6, 1)):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, V, size=n).tolist() for n in lengths]


def test_ragged_and_bucketed_equal_each_row_alone(lm):
    rows, n = _rows(), 5
    out, lengths = generate(lm, rows, n, return_lengths=True)              # bucket 8, left padded
    assert out.shape == (3, 6 + n) and out.dtype == jnp.int32
    np.testing.assert_array_equal(lengths, [3 + n, 6 + n, 1 + n])
    for b, r in enumerate(rows):
        alone = np.asarray(generate(lm, jnp.asarray([r]), n, bucket=False))[0]   # today's program, unpadded
        np.testing.assert_array_equal(out[b, :len(r) + n], alone, err_msg=f"row {b}")
        assert np.all(np.asarray(out[b, len(r) + n:]) == 0)
    # the same prompts right-padded in an array with prompt_lengths, and without buckets
    padded = np.full((3, 6), 7, np.int32)
    for b, r in enumerate(rows):
        padded[b, :len(r)] = r
    np.testing.assert_array_equal(generate(lm, padded, n, prompt_lengths=[3, 6, 1]), out)
    np.testing.assert_array_equal(generate(lm, rows, n, bucket=False), out)
    np.testing.assert_array_equal(generate(lm, [jnp.asarray(r) for r in rows], n), out)
    # equal-length prompts off a bucket (3 -> 4) give the tokens of the unpadded program
    eq = jnp.asarray([rows[1][:3], rows[0]], jnp.int32)
    np.testing.assert_array_equal(generate(lm, eq, n), generate(lm, eq, n, bucket=False))


def test_eos_and_stop_sequences_stop_rows_and_pad(lm1):
    lm = lm1
    rows, n = _rows(1, (4, 2, 3)), 8
    free = np.asarray(generate(lm, rows, n))
    new = [free[b, len(r):len(r) + n] for b, r in enumerate(rows)]
    eos = int(new[0][2])                                     # row 0 emits it at its third new token

    def expected(stop_at):                                   # stop_at[b]: new tokens kept in row b
        want = np.full_like(free, -1)
        for b, r in enumerate(rows):
            want[b, :len(r) + stop_at[b]] = free[b, :len(r) + stop_at[b]]
        return want

    def first_end(seq, pattern):                             # new tokens up to the end of the first match
        for i in range(len(pattern), len(seq) + 1):
            if list(seq[i - len(pattern):i]) == list(pattern):
                return i
        return len(seq)

    out, lengths = generate(lm, rows, n, eos_token_id=eos, pad_token_id=-1, return_lengths=True)
    stop_at = [first_end(s, [eos]) for s in new]
    assert stop_at[0] <= 3
    np.testing.assert_array_equal(out, expected(stop_at))
    np.testing.assert_array_equal(lengths, [len(r) + k for r, k in zip(rows, stop_at)])

    pattern = [int(t) for t in new[1][3:5]]                  # a two-token stop sequence from row 1
    out = generate(lm, rows, n, stop_sequences=[pattern, [V - 1] * 3], eos_token_id=[eos], pad_token_id=-1)
    stop_at = [min(first_end(s, [eos]), first_end(s, pattern)) for s in new]
    assert stop_at[1] <= 5
    np.testing.assert_array_equal(out, expected(stop_at))


def test_stream_receives_every_token_in_order(lm1):
    lm = lm1
    rows, n = _rows(2, (2, 5)), 6
    calls = []
    out = generate(lm, rows, n, stream=lambda i, tok, done: calls.append((i, tok.copy(), done.copy())))
    assert [c[0] for c in calls] == list(range(n))
    assert all(c[1].dtype == np.int32 and c[1].shape == (2,) and c[2].dtype == bool for c in calls)
    streamed = np.stack([c[1] for c in calls], axis=1)
    for b, r in enumerate(rows):
        np.testing.assert_array_equal(streamed[b], out[b, len(r):len(r) + n])
    np.testing.assert_array_equal(out, generate(lm, rows, n))            # same tokens as the fused loop
    assert not any(c[2].any() for c in calls)

    eos = int(streamed[0, 1])                                # every row stops: the calls end early
    calls.clear()
    out, lengths = generate(lm, rows, n, eos_token_id=eos, stop_sequences=[streamed[1, :2].tolist()],
                            return_lengths=True, stream=lambda i, tok, done: calls.append((i, tok, done)))
    assert calls[-1][2].all() and len(calls) <= 2 and len(calls) == int(max(lengths - np.array([2, 5])))
    np.testing.assert_array_equal(out, generate(lm, rows, n, eos_token_id=eos,
                                                stop_sequences=[streamed[1, :2].tolist()]))


def test_bucketing_reuses_compiled_programs():
    lm = MambaLM(dataclasses.replace(CFGS["mamba1"], n_layers=1), V, rngs=nnx.Rngs(0))
    size = gen_module._decode._cache_size
    before = size()
    for p in (5, 6, 7):                                      # one bucket (8), one program
        generate(lm, jnp.ones((2, p), jnp.int32), 3)
    assert size() - before == 1
    generate(lm, [[1, 2], [3, 4, 5, 6, 7]], 3)               # ragged, same batch and bucket: same program
    assert size() - before == 1
    for p in (5, 6):                                         # without buckets: one program per length
        generate(lm, jnp.ones((2, p), jnp.int32), 3, bucket=False)
    assert size() - before == 3


def test_bad_arguments_name_the_argument():
    lm = MambaLM(CFGS["mamba1"], V, rngs=nnx.Rngs(0))
    p = jnp.zeros((2, 4), jnp.int32)
    cases = [
        (ValueError, "prompt_lengths must have shape", dict(prompt_lengths=[1, 2, 3])),
        (ValueError, r"prompt_lengths must lie in \[1, .* = 4\]", dict(prompt_lengths=[0, 2])),
        (ValueError, "prompt_lengths must lie", dict(prompt_lengths=[5, 2])),
        (TypeError, "prompt_lengths must hold ints", dict(prompt_lengths=[1.0, 2.0])),
        (ValueError, r"eos_token_id: 13 is not a token id in \[0, 13\)", dict(eos_token_id=13)),
        (TypeError, "eos_token_id", dict(eos_token_id="2")),
        (ValueError, r"stop_sequences\[1\] must not be empty", dict(stop_sequences=[[1], []])),
        (ValueError, r"stop_sequences\[0\]: -1", dict(stop_sequences=[[-1, 2]])),
        (TypeError, "stop_sequences must be a list of token-id lists", dict(stop_sequences=[1, 2])),
        (TypeError, "stream must be None or a callable", dict(stream=3)),
        (TypeError, "bucket must be a bool", dict(bucket=1)),
        (TypeError, "pad_token_id", dict(pad_token_id=1.5)),
    ]
    for exc, msg, kw in cases:
        with pytest.raises(exc, match=msg):
            generate(lm, p, 2, **kw)
    with pytest.raises(ValueError, match="prompt_lengths must be None when prompt_ids is a list"):
        generate(lm, [[1], [2, 3]], 2, prompt_lengths=[1, 2])
    with pytest.raises(ValueError, match=r"prompt_ids\[1\] must be a non-empty list"):
        generate(lm, [[1], []], 2)
    with pytest.raises(ValueError, match=r"prompt_ids must lie in \[0, 13\): prompt_ids\[1, 0\] = 13"):
        generate(lm, [[1], [13, 2]], 2)
    # ids past a row's length are ignored, not checked
    out = generate(lm, jnp.asarray([[1, 99], [2, 3]]), 0, prompt_lengths=[1, 2], pad_token_id=-1)
    np.testing.assert_array_equal(out, [[1, -1], [2, 3]])


def _run_sample(*args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "jmamba.sample", *args], capture_output=True, text=True,
                          env=env, timeout=300, cwd=ROOT)


def test_sample_command_end_to_end(tmp_path):
    lm = MambaLM(Mamba1Config(d_model=8, n_layers=1, d_state=4), 256, rngs=nnx.Rngs(0))
    model = lm.save_pretrained(os.path.join(tmp_path, "model"))
    want = np.asarray(generate(lm, jnp.asarray([list(b"ab")]), 6))[0, 2:]
    text = bytes(want.astype(np.uint8).tolist()).decode("utf-8", errors="replace")
    r = _run_sample("--model", model, "--prompt", "ab", "--max-new-tokens", "6", "--stream")
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == text, (r.stdout, text)
    # (refused flags: in test_sample_main_in_process, without a process start each)


def test_sample_main_in_process(tmp_path, capsys):
    from jmamba.sample import main
    lm = MambaLM(Mamba1Config(d_model=8, n_layers=1, d_state=4), 256, rngs=nnx.Rngs(1))
    model = lm.save_pretrained(os.path.join(tmp_path, "model"))
    want = np.asarray(generate(lm, jnp.asarray([list("hé".encode())]), 4, temperature=0.8, top_k=5,
                               rng=__import__("jax").random.PRNGKey(3)))[0, 3:]
    assert main(["--model", model, "--prompt", "hé", "--max-new-tokens", "4", "--temperature", "0.8",
                 "--top-k", "5", "--seed", "3"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == bytes(want.astype(np.uint8).tolist()).decode("utf-8", "replace")
    for argv, flag in ([["--max-new-tokens", "-1"], "--max-new-tokens"], [["--top-k", "0"], "--top-k"],
                       [["--top-k", "300"], "--top-k"], [["--precision", "f64"], "--precision"],
                       [["--tokenizer", os.path.join(tmp_path, "nope.json")], "--tokenizer"],
                       [["--eos-id", "256"], "--eos-id"], [["--top-p", "1.5"], "--top-p"],
                       [["--model", os.path.join(tmp_path, "missing")], "--model"]):
        with pytest.raises(SystemExit) as e:
            main(["--model", model, "--prompt", "ab", *argv])
        assert e.value.code == 2
        assert flag in capsys.readouterr().err
    open(os.path.join(tmp_path, "tok.json"), "w").close()
    with pytest.MonkeyPatch.context() as mp, pytest.raises(SystemExit) as e:
        mp.setitem(sys.modules, "tokenizers", None)                       # as if not installed
        main(["--model", model, "--prompt", "ab", "--tokenizer", os.path.join(tmp_path, "tok.json")])
    assert e.value.code == 2 and "pip install 'jmamba[hf]'" in capsys.readouterr().err


def test_sample_with_a_tokenizer(tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    from jmamba.sample import main
    words = ["<eos>", "a", "b", "c", "d", "e", "f", "g", "h", "i"]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<eos>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok_path = os.path.join(tmp_path, "tokenizer.json")
    tok.save(tok_path)
    lm = MambaLM(Mamba1Config(d_model=8, n_layers=1, d_state=4), len(words), rngs=nnx.Rngs(2))
    model = lm.save_pretrained(os.path.join(tmp_path, "model"))
    want = np.asarray(generate(lm, jnp.asarray([[1, 2, 3]]), 5))[0, 3:].tolist()
    assert main(["--model", model, "--tokenizer", tok_path, "--prompt", "a b c", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.strip() == tok.decode(want)
