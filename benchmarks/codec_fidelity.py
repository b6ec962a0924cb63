"""How much of a real pseudo-gradient each Di-PS codec keeps: llama-tiny trained with AdamW
(the benchmark's inner optimizer) from theta_0, H inner steps a round, and each round's
pseudo-gradient encoded once by every codec (no error feedback). Prints each codec's bytes
against BF16's and the cosine and relative L2 error between the pseudo-gradient and what a
receiver decodes, per round; with AdamW the values are nearly flat (the largest is a few times
the mean magnitude), so a top-k codec keeps little of the vector and a sign codec most of it.

    .venv/bin/python benchmarks/codec_fidelity.py [--rounds 3] [--inner-steps 16]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from dimodel.datasets import sample_batch, text_corpus  # noqa: E402
from dips.codec import Codec  # noqa: E402
from dips.model import build_model, load_config  # noqa: E402

CODECS = "int8,int4,sign,sign:0.5,sign:0.25,topk:0.02,sparse:0.03,sparse:0.1"


def pseudo_gradients(model_cfg: dict, rounds: int, inner_steps: int, lr: float) -> list[torch.Tensor]:
    """Each round's theta_start - theta_end, flat, as one cluster training alone makes them."""
    torch.manual_seed(0)
    model = build_model(model_cfg, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    train, _ = text_corpus()
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(rounds):
        start = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
        for _ in range(inner_steps):
            model.loss(sample_batch(train, 8, 32, gen)).backward()
            opt.step()
            opt.zero_grad()
        out.append(start - torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "examples/configs/llama-tiny.yaml"))
    ap.add_argument("--codecs", default=CODECS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--inner-steps", type=int, default=16)
    ap.add_argument("--inner-lr", type=float, default=3e-3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    deltas = pseudo_gradients(load_config(args.model), args.rounds, args.inner_steps, args.inner_lr)
    n = deltas[0].numel()
    print(f"{n} values; max / mean magnitude per round: "
          + ", ".join(f"{float(d.abs().max() / d.abs().mean()):.1f}" for d in deltas))
    print(f"{'codec':>12} {'vs bf16':>8} " + " ".join(f"{'cos r' + str(r):>7} {'err r' + str(r):>7}"
                                                     for r in range(len(deltas))))
    for spec in args.codecs.split(","):
        codec = Codec.parse(spec)
        cells = []
        for d in deltas:
            dec = codec.round_trip(d)[1]
            cells.append(f"{float(torch.dot(d, dec) / (d.norm() * dec.norm())):7.3f} "
                         f"{float((d - dec).norm() / d.norm()):7.3f}")
        print(f"{spec:>12} {2 * n / codec.payload_bytes(n):7.1f}x " + " ".join(cells))
    print("(cos: cosine between the pseudo-gradient and its decoded value; err: |x - decoded| / |x|; "
          "the model is encoded as one unit here, ditorch ps bytes counts unit by unit)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
