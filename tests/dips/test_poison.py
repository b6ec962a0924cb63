"""A cluster pushing parameters scaled by 100 is rejected by the penalty and changes nothing;
without the penalty (async DiLoCo) the same push wrecks the model."""
import torch

from dips.client import OuterClient
from dimodel.datasets import sample_batch, text_corpus
from dips.harness import evaluate
from dips.model import build_model

from pscluster import MODEL, global_params, in_process_ps

H, ROUNDS = 4, 6


def train_run(tmp_path, mode: str, poisoner: bool):
    train, held_out = text_corpus()
    torch.manual_seed(0)
    with in_process_ps(tmp_path, mode=mode) as (leader, _, token):
        honest = []
        for i in range(2):
            model = build_model(MODEL, 10 + i)
            client = OuterClient(model, leader.address, inner_steps=H, token=token, name=f"h{i}")
            honest.append((model, client, torch.optim.AdamW(model.parameters(), lr=3e-3),
                           torch.Generator().manual_seed(i)))
        bad = None
        rejected = 0
        for r in range(ROUNDS):
            for model, client, opt, gen in honest:
                for _ in range(H):
                    x = sample_batch(train, 8, 32, gen)
                    model.loss(x).backward()
                    opt.step()
                    opt.zero_grad()
                    client.step(tokens=x.numel())
            if poisoner and r >= 2:  # after the penalty's warm-up rounds
                if bad is None:
                    bad_model = build_model(MODEL, 99)
                    bad = OuterClient(bad_model, leader.address, inner_steps=1, token=token, name="poison")
                with torch.no_grad():
                    for p in bad_model.parameters():
                        p.mul_(100.0)
                bad.step(tokens=8 * 33 * H)
                rejected += bad.stats["rejected"] - rejected
        params = global_params(leader, token)
        for _, c, _, _ in honest:
            c.close()
        if bad is not None:
            bad.close()
    model = build_model(MODEL, 0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params[n])
    return params, evaluate(model, held_out, batches=4), rejected


def test_poisoned_push_rejected_and_loss_unaffected(tmp_path):
    clean, clean_loss, _ = train_run(tmp_path / "clean", "dips", poisoner=False)
    attacked, attacked_loss, rejected = train_run(tmp_path / "attacked", "dips", poisoner=True)
    assert rejected == ROUNDS - 2                     # every poisoned push was flagged
    assert attacked_loss == clean_loss                 # the global model is exactly the clean one
    assert all(torch.equal(clean[n], attacked[n]) for n in clean)
    initial = evaluate(build_model(MODEL, 0), text_corpus()[1], batches=4)
    assert clean_loss < initial - 0.5                  # and training did make progress
    _, unguarded_loss, _ = train_run(tmp_path / "unguarded", "async", poisoner=True)
    assert not unguarded_loss < clean_loss + 1.0       # without the penalty the push does harm
