"""The main job's training loop: --help, metrics.jsonl with train and held-out rows, loss.png, the saved
pretrained model, --tokenizer (a tokenizer.json made here with the `tokenizers` package)."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from jmamba.train_char_lm import build_parser, main, parse_args
from jmamba.training.metrics_log import read_metrics, tensorboard_available

TINY = ["--d-model", "16", "--n-layers", "1", "--d-state", "4", "--seq-len", "16", "--batch-size", "4",
        "--sample-tokens", "8"]


def test_help_shows_a_default_for_every_flag(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out.split("options:", 1)[1]
    blocks = {b.split()[0].rstrip(","): b for b in re.split(r"\n  (?=-)", text) if b.strip().startswith("-")}
    flags = [a for a in build_parser()._actions if a.option_strings and a.dest != "help"]
    assert len(flags) > 20
    for a in flags:
        assert a.help, f"{a.option_strings[0]} has no help string (so --help shows no default)"
        assert "(default:" in blocks[a.option_strings[0]], f"--help shows no default for {a.option_strings[0]}"


def test_unusable_tokenizer_file_is_a_flag_error(tmp_path, capsys):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(SystemExit) as e:
        parse_args(["--tokenizer", str(bad)])
    assert e.value.code == 2 and "--tokenizer" in capsys.readouterr().err


def make_tokenizer_json(path, text):
    """A byte-level BPE tokenizer.json of 300 tokens trained on `text`."""
    tk = pytest.importorskip("tokenizers", reason="the jmamba[hf] extra (tokenizers) is not installed")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    tok.train_from_iterator([text], tk.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.save(str(path))
    return tok


def test_tokenizer_json_trains_saves_and_a_resume_with_bytes_is_refused(tmp_path, capsys):
    from jmamba.data.corpus import default_corpus_bytes

    text = default_corpus_bytes(12000).decode("utf-8", errors="replace")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    tok_path = tmp_path / "my_tokenizer.json"
    make_tokenizer_json(tok_path, text)
    out = str(tmp_path / "run")
    tb = ["--tensorboard"] if tensorboard_available() else []
    assert main(["--tokenizer", str(tok_path), "--text", str(corpus), "--steps", "12", "--eval-every", "6",
                 "--out", out, *tb, *TINY]) == 0
    printed = capsys.readouterr().out
    assert "nats/token" in printed and "(uniform would be 5.704)" in printed   # ln 300
    # the pretrained directory holds the tokenizer's vocabulary and a copy of the tokenizer
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["config"]["vocab_size"] == 300
    with open(os.path.join(out, "tokenizer.json")) as f, open(tok_path) as g:
        assert f.read() == g.read()
    assert [r["step"] for r in read_metrics(out, split="eval")] == [6, 12]
    if tb:
        assert any(n.startswith("events.out.tfevents") for n in os.listdir(os.path.join(out, "tensorboard")))
    sample = printed.split("---- sample ----\n")[1].split("\n----------------")[0]
    assert sample.startswith("def ")
    # the same --out with the byte tokenizer: refused by the tokenizer fingerprint, in one line
    assert main(["--text", str(corpus), "--steps", "14", "--out", out, *TINY]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "tokenizer" in err[0] and "--fresh" in err[0]


def test_byte_tokenizer_round_trips():
    from jmamba.data.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    ids = tok.encode("déf ✓")
    assert ids.dtype == np.int32 and tok.vocab_size == 256 and tok.decode(ids) == "déf ✓"
    assert tok.fingerprint() == {"kind": "bytes", "vocab_size": 256}
