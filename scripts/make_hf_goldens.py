"""Write small random transformers `MambaForCausalLM` checkpoints and their outputs (golden files).

Run where torch and transformers are installed (e.g. the GPU image's python3, or a CPU venv with
`pip install torch transformers safetensors`), from the repo root:

    python scripts/make_hf_goldens.py            # writes tests/goldens/hf_mamba_*/

Each case directory holds `config.json` + `model.safetensors` (exactly what `save_pretrained` writes)
and `golden.npz` with `input_ids [2, 9]`, the f32 `logits [2, 9, V]` of the pure-torch slow path on the
CPU, and a greedy `generate` continuation (`prompt [2, 5]` -> `greedy [2, 5 + 12]`). Every parameter
is perturbed away from its init (D != 1, norms != 1) so the goldens pin each convention. The
versions used are written to `versions.json`. tests/test_hf_goldens.py checks jmamba against them.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
import transformers
from transformers import MambaConfig, MambaForCausalLM

CASES = {
    # name: (config kwargs, tie)
    "hf_mamba_tied": (dict(hidden_size=16, num_hidden_layers=2, state_size=4, conv_kernel=4, expand=2,
                           time_step_rank="auto", vocab_size=48), True),
    "hf_mamba_untied": (dict(hidden_size=24, num_hidden_layers=3, state_size=6, conv_kernel=3, expand=2,
                             time_step_rank=5, vocab_size=40), False),
}


def make_case(out_dir, kwargs, tie, seed):
    torch.manual_seed(seed)
    cfg = MambaConfig(**kwargs, layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True,
                      tie_word_embeddings=tie, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    model = MambaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(0.1 * torch.randn_like(p))
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    for extra in ("generation_config.json",):
        path = os.path.join(out_dir, extra)
        if os.path.exists(path):
            os.remove(path)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(1, cfg.vocab_size, (2, 9), generator=g)
    with torch.no_grad():
        logits = model(ids).logits.float().numpy()
        prompt = ids[:, :5]
        greedy = model.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12,
                                pad_token_id=0, eos_token_id=None).numpy()
    np.savez(os.path.join(out_dir, "golden.npz"), input_ids=ids.numpy(), logits=logits,
             prompt=prompt.numpy(), greedy=greedy)


def main():
    root = os.path.join(os.path.dirname(__file__), "..", "tests", "goldens")
    for i, (name, (kwargs, tie)) in enumerate(CASES.items()):
        make_case(os.path.join(root, name), kwargs, tie, seed=i)
        print("wrote", name)
    with open(os.path.join(root, "versions.json"), "w") as f:
        json.dump({"torch": torch.__version__, "transformers": transformers.__version__,
                   "python": sys.version.split()[0]}, f, indent=2)


if __name__ == "__main__":
    main()
