"""A cluster process for transport tests: joins the PS, runs outer rounds, prints what it saw.

``python ps_cluster_proc.py LEADER TOKEN_FILE MODEL_YAML ROUNDS [TLS_CA]``
"""
import json
import sys

import torch

from dips.client import OuterClient
from dips.model import build_model, load_config
from dips.rpc import Tls


def main() -> None:
    leader, token_file, model_yaml, rounds = sys.argv[1:5]
    tls = Tls(sys.argv[5]) if len(sys.argv) > 5 else None
    model = build_model(load_config(model_yaml), seed=1)
    client = OuterClient(model, leader, inner_steps=1, token_file=token_file, name="remote", join=False, tls=tls)
    if not client.join(timeout_s=60):
        raise SystemExit(f"could not join the PS at {leader}")
    gen = torch.Generator().manual_seed(0)
    for _ in range(int(rounds)):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 1e-3)
        client.step(tokens=64)
    print(json.dumps({"base": client.base, "followers": client.plan["followers"], "stats": client.stats}), flush=True)
    client.close()


if __name__ == "__main__":
    main()
