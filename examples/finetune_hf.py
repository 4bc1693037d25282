"""Fine-tune a transformers `MambaForCausalLM` checkpoint (e.g. state-spaces/mamba-130m-hf) on a text file.

    python examples/finetune_hf.py --model path/to/mamba-130m-hf --text my.txt --steps 200 --out ft/

The directory needs `config.json` and `model.safetensors` (download it yourself; nothing is fetched).
Text is tokenized with the directory's `tokenizer.json` when present (needs the `tokenizers` package),
otherwise as bytes (only for models whose vocabulary has at least 256 entries). The fine-tuned model is
written back as an HF directory (`--out`), loadable by transformers and by `jmamba.load_hf_mamba`.
"""

from __future__ import annotations

import argparse
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmamba
from jmamba.data.streams import StreamBatcher


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF MambaForCausalLM directory")
    p.add_argument("--text", required=True, help="UTF-8 text file to fine-tune on")
    p.add_argument("--out", required=True, help="where to write the fine-tuned HF directory")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--precision", choices=["f32", "bf16", "f16"], default="f32")
    p.add_argument("--prompt", default="The")
    return p.parse_args(argv)


class Tokenizer:
    """tokenizer.json (HF `tokenizers`) when present, else bytes."""

    def __init__(self, model_dir, vocab_size):
        path = os.path.join(model_dir, "tokenizer.json")
        self.hf = None
        if os.path.isfile(path):
            from tokenizers import Tokenizer as HFTokenizer
            self.hf = HFTokenizer.from_file(path)
        elif vocab_size < 256:
            raise ValueError(f"{model_dir} has no tokenizer.json and its vocabulary ({vocab_size}) is too "
                             "small for byte-level text")

    def encode(self, text):
        return np.asarray(self.hf.encode(text).ids if self.hf else list(text.encode("utf-8")), np.int32)

    def decode(self, ids):
        ids = [int(i) for i in ids]
        return self.hf.decode(ids) if self.hf else bytes(i % 256 for i in ids).decode("utf-8", "replace")


def main(argv=None):
    args = parse_args(argv)
    lm = jmamba.load_hf_mamba(args.model)
    tok = Tokenizer(args.model, lm.config.vocab_size)
    tokens = tok.encode(open(args.text, encoding="utf-8").read())
    print(f"loaded {args.model}: {lm.config.backbone} vocab={lm.config.vocab_size}; {len(tokens):,} tokens")

    opt = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, args.lr, min(50, args.steps // 5 + 1),
                                                         args.steps, args.lr * 0.1), weight_decay=0.0)
    state = jmamba.TrainState.create(lm, opt, args.batch_size, precision=args.precision)
    loss_fn = lambda logits, b: optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"]).mean()
    step = jmamba.make_train_step(lm, opt, loss_fn=loss_fn, precision=args.precision, clip_max_norm=1.0)
    batches = StreamBatcher(tokens, args.batch_size, min(args.seq_len, len(tokens) - 2))
    losses = []
    for i in range(args.steps):
        state, m = step(state, {k: jnp.asarray(v) for k, v in batches.next().items()})
        losses.append(float(m["loss"]))
        if i % 20 == 0 or i == args.steps - 1:
            print(f"step {i:5d}  loss {np.mean(losses[-20:]):.4f}")

    from flax import nnx
    nnx.update(lm, state.params)
    if os.path.isdir(args.out):
        shutil.rmtree(args.out)
    jmamba.save_hf_mamba(args.out, lm)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.isfile(os.path.join(args.model, name)):
            shutil.copy(os.path.join(args.model, name), args.out)
    print(f"fine-tuned model written to {args.out}")
    out = jmamba.generate(lm, jnp.asarray(tok.encode(args.prompt))[None], 40, temperature=0.8, top_k=20,
                          rng=jax.random.PRNGKey(0))
    print("sample:", tok.decode(np.asarray(out[0])))
    return losses


if __name__ == "__main__":
    main()
