"""Sample a continuation of a prompt from a saved jmamba language model.

    python -m jmamba.sample --model runs/char_lm --prompt "def " --max-new-tokens 200 --stream
    python -m jmamba.sample --model runs/char_lm/checkpoints --prompt "def " --temperature 0.8 --top-k 40
    python -m jmamba.sample --model DIR --tokenizer tokenizer.json --prompt "Mamba is" --eos-id 0

`--model` is a `MambaLM.save_pretrained` directory or a training-checkpoint directory (its newest
step, or `--step`). The prompt is encoded as UTF-8 bytes (token id = byte, as `jmamba.data.corpus`
and `python -m jmamba.train_char_lm` do) unless `--tokenizer` names a Hugging Face `tokenizers`
JSON file. Only the continuation is printed. Every flag is checked before the model is loaded
(errors name the flag, exit status 2); `--top-k`, `--eos-id` and the prompt ids are checked against
the vocabulary right after loading.
"""

from __future__ import annotations

import argparse
import codecs
import math
import os
import sys


def _number(kind, lo, hi=None, *, strict=False, hi_strict=False):
    """An argparse type: a finite `kind` in the interval; the message names the bounds."""
    def parse(text):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}")
        if not math.isfinite(v) or (v <= lo if strict else v < lo) or (
                hi is not None and (v >= hi if hi_strict else v > hi)):
            low = f"{'>' if strict else '>='} {lo}"
            raise argparse.ArgumentTypeError(f"must be {low}" + ("" if hi is None else f" and <= {hi}") + f", got {text}")
        return v
    parse.__name__ = kind.__name__
    return parse


def build_parser():
    p = argparse.ArgumentParser(prog="python -m jmamba.sample", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, default=argparse.SUPPRESS,
                   help="a MambaLM.save_pretrained directory or a training-checkpoint directory")
    p.add_argument("--prompt", required=True, default=argparse.SUPPRESS, help="the text to continue (must not be empty)")
    p.add_argument("--tokenizer", default=None,
                   help="a Hugging Face tokenizer.json (needs the `tokenizers` package); None: UTF-8 bytes")
    p.add_argument("--max-new-tokens", type=_number(int, 0), default=200, help="tokens to generate")
    p.add_argument("--temperature", type=_number(float, 0.0), default=0.0,
                   help="sampling temperature (0: greedy)")
    p.add_argument("--top-k", type=_number(int, 1), default=None,
                   help="sample among the k most likely tokens only; None: all")
    p.add_argument("--top-p", type=_number(float, 0.0, 1.0, strict=True), default=None,
                   help="nucleus sampling: the smallest set of tokens whose probability reaches p, in (0, 1]; "
                        "None: off")
    p.add_argument("--eos-id", type=_number(int, 0), action="append", default=None,
                   help="stop after this token id (repeat the flag for several); None: no stop token")
    p.add_argument("--seed", type=int, default=0, help="random seed of the sampling")
    p.add_argument("--precision", choices=["f32", "bf16", "f16"], default="f32", help="compute precision")
    p.add_argument("--step", type=_number(int, 0), default=None,
                   help="checkpoint step to load (checkpoint directories only); None: the newest")
    p.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    return p


def parse_args(argv=None):
    """Parses and checks every flag before any work: errors name the flag (exit status 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not os.path.isdir(args.model):
        parser.error(f"argument --model: no such directory {args.model!r}")
    if args.tokenizer is not None:
        if not os.path.isfile(args.tokenizer):
            parser.error(f"argument --tokenizer: no such file {args.tokenizer!r}")
        try:
            import tokenizers  # noqa: F401
        except ImportError:
            parser.error("argument --tokenizer: needs the Hugging Face `tokenizers` package, which is not "
                         "installed: pip install 'jmamba[hf]'")
    if not args.prompt:
        parser.error("argument --prompt: must not be empty")
    if args.step is not None and os.path.isfile(os.path.join(args.model, "config.json")):
        parser.error(f"argument --step: {args.model} is a pretrained directory, not a checkpoint directory")
    return parser, args


class _ByteCodec:
    """UTF-8 bytes as token ids (vocabulary 256); decoding streams through an incremental decoder."""

    vocab_size = 256

    def encode(self, text):
        return list(text.encode("utf-8"))

    def streamer(self):
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return lambda ids, final=False: dec.decode(bytes(ids), final=final)


class _HFCodec:
    """A `tokenizers.Tokenizer`; streaming decodes everything generated so far and prints the new suffix."""

    def __init__(self, path):
        import tokenizers   # parse_args checked that it imports

        self.tok = tokenizers.Tokenizer.from_file(path)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text):
        return self.tok.encode(text, add_special_tokens=False).ids

    def streamer(self):
        ids, shown = [], [0]

        def feed(new, final=False):
            ids.extend(new)
            text = self.tok.decode(ids)
            if not final and text.endswith("\ufffd"):    # an incomplete character: wait for more
                return ""
            out, shown[0] = text[shown[0]:], len(text)
            return out
        return feed


def main(argv=None) -> int:
    parser, args = parse_args(argv)
    codec = _HFCodec(args.tokenizer) if args.tokenizer else _ByteCodec()

    import jax

    from jmamba.generate import generate
    from jmamba.lm import MambaLM
    import jmamba.io  # noqa: F401  (registers MambaLM.from_pretrained)

    try:
        lm = MambaLM.from_pretrained(args.model, step=args.step)
    except (FileNotFoundError, ValueError) as e:
        parser.error(f"argument --model: {e}")
    vocab = lm.config.vocab_size
    if args.top_k is not None and args.top_k > vocab:
        parser.error(f"argument --top-k: must be <= the vocabulary size {vocab}, got {args.top_k}")
    for eos in args.eos_id or []:
        if eos >= vocab:
            parser.error(f"argument --eos-id: {eos} is not a token id of the model (vocabulary {vocab})")
    ids = codec.encode(args.prompt)
    if not ids:
        parser.error("argument --prompt: encodes to no tokens")
    if max(ids) >= vocab:
        what = "--tokenizer's" if args.tokenizer else "byte"
        parser.error(f"argument --prompt: {what} id {max(ids)} is not in the model's vocabulary of {vocab}"
                     + ("" if args.tokenizer else " (pass --tokenizer)"))

    decode = codec.streamer()
    state = {"done": False}

    def on_token(i, tokens, done):
        if state["done"]:
            return
        sys.stdout.write(decode([int(tokens[0])]))
        sys.stdout.flush()
        state["done"] = bool(done[0])

    out, lengths = generate(lm, [ids], args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, rng=jax.random.PRNGKey(args.seed), precision=args.precision,
                            eos_token_id=args.eos_id, stream=on_token if args.stream else None,
                            return_lengths=True)
    if args.stream:
        sys.stdout.write(decode([], final=True) + "\n")
    else:
        new = [int(t) for t in out[0, len(ids):int(lengths[0])]]
        sys.stdout.write(decode(new, final=True) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
