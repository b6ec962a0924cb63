"""Bring your own model and data: a Hugging Face Qwen3-style model trained over two chip types.

Runs, as a user would, each command of the workflow with a model given as a Hugging Face
``config.json`` (``examples/hf/qwen3-tiny``: tied embeddings, per-head q/k norms) and a token
file made from the text this repository ships (its docs), and shows what each prints:

1. ``ditorch data prepare``: the docs tokenized with ``examples/hf/tokenizer.json`` (a byte-level
   BPE of 2048 tokens trained on the docs: ``--retrain-tokenizer`` makes it again);
2. ``ditorch profile``: the model's own decoder layer measured on chips A and C at TP 1 and 2;
3. ``ditorch plan``: HeteroAuto over one A and two C chips;
4. ``torchrun -m ditorch.train --data``: the heterogeneous run, the held-out loss every 10 steps,
   the model exported to ``out/hf/ckpt/hf`` in Hugging Face's format;
5. ``python -m ditorch.train --reference``: the same ``Qwen3ForCausalLM`` in one CPU process, fp32;
6. ``ditorch mre``: the loss curves' Mean Relative Error against the H2 paper's 1.5%;
7. ``AutoModelForCausalLM.from_pretrained`` of the export, and a greedy continuation of a prompt.

    python examples/hf_demo.py [--steps 60] [--chips A:1,C:2] [--reprofile]

Needs the ``hf`` extra (``transformers``; ``make setup`` installs it). Outputs land in ``out/hf``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))

from hetero_demo import run, usable_profile  # noqa: E402

from heteropp.model_spec import ModelSpec  # noqa: E402
from heteropp.runtime.profiler import cluster_time_scale, write_cluster  # noqa: E402

MODEL = REPO / "examples" / "hf" / "qwen3-tiny"
TOKENIZER = REPO / "examples" / "hf" / "tokenizer.json"


def texts() -> list[Path]:
    """The text the repository ships: its README and docs."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def train_tokenizer(path: Path, vocab: int = 2048) -> None:
    """A byte-level BPE of ``vocab`` tokens trained on ``texts()`` (how tokenizer.json was made)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(t) for t in texts()], trainer)
    tok.save(str(path))


def show_generation(export: Path, prompt: str = "The pipeline runtime") -> None:
    """Load the export as any Hugging Face model is loaded and continue ``prompt`` greedily."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    print(f"\n[7/7] AutoModelForCausalLM.from_pretrained({str(export.relative_to(REPO))!r})", flush=True)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    tok = Tokenizer.from_file(str(TOKENIZER))
    ids = tok.encode(prompt).ids
    with torch.no_grad():
        for _ in range(24):
            logits = model(input_ids=torch.tensor([ids[-model.config.max_position_embeddings:]])).logits
            ids.append(int(logits[0, -1].argmax()))
    print(f"   {type(model).__name__}, {sum(p.numel() for p in model.parameters()):,} parameters")
    print(f"   greedy continuation: {tok.decode(ids)!r}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--chips", default="A:1,C:2", help="chip type:count pairs of the emulated cluster")
    p.add_argument("--gbs", default="1K", help="global batch in tokens (1K = 8 sequences of 128)")
    p.add_argument("--memory-scale", default="0.01")
    p.add_argument("--reprofile", action="store_true", help="measure the chips again even if profiles exist")
    p.add_argument("--retrain-tokenizer", action="store_true", help="train examples/hf/tokenizer.json again")
    p.add_argument("--out", default="out/hf")
    args = p.parse_args(argv)
    counts = {name: int(n) for name, n in (pair.split(":") for pair in args.chips.split(","))}
    out = REPO / args.out
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, DITORCH_MEMORY_SCALE=args.memory_scale, PYTHONPATH=str(REPO))
    py, world = sys.executable, sum(counts.values())
    ditorch = [py, "-m", "ditorch.cli"]
    started = time.perf_counter()
    # Every chip runs at its datasheet's roofline times one time scale, chosen (as in
    # hetero_demo.py) so this host keeps up with every chip while ranks outnumber cores, and kept
    # with the profiles taken at it (docs/device.md, "Speed").
    chosen = out / "time-scale.json"
    if chosen.exists() and not args.reprofile:
        time_scale = float(json.loads(chosen.read_text())["time_scale"])
        print(f"\n[0/7] time scale {time_scale:g}, chosen before ({chosen}; --reprofile to choose again)")
    else:
        time_scale, ratios = cluster_time_scale([counts], ModelSpec.load(MODEL))
        print(f"\n[0/7] this host's time for a layer of {MODEL.name} against each chip's: "
              + ", ".join(f"{c} {r:.1f}x" for c, r in ratios.items())
              + f"; {world} ranks on {os.cpu_count()} cores run at time scale {time_scale:g}", flush=True)
        chosen.write_text(json.dumps({"time_scale": time_scale, "host_ratios": ratios}) + "\n")

    if args.retrain_tokenizer or not TOKENIZER.exists():
        train_tokenizer(TOKENIZER)
    data = out / "docs.bin"
    run([*ditorch, "data", "prepare", "--tokenizer", str(TOKENIZER), *map(str, texts()), str(data)], env, "1/7")
    for chip in counts:
        profile = out / f"chip-{chip}.yaml"
        if args.reprofile or not usable_profile(profile, chip, time_scale):
            run([*ditorch, "profile", "--chip", chip, "--model", str(MODEL), "--tp", "1,2", "--time-scale",
                 f"{time_scale:g}", "--out", str(profile)], env, "2/7")
        else:
            print(f"\n[2/7] chip {chip}: using the profile measured before ({profile}; --reprofile to measure again)")
    cluster = write_cluster(out / "cluster-emu.yaml", counts)
    plan = out / "plan.json"
    run([*ditorch, "plan", "--cluster", str(cluster), "--model", str(MODEL), "--gbs", args.gbs, "--out", str(plan)],
        env, "3/7")
    common = ["--plan", str(plan), "--steps", str(args.steps), "--data", str(data), "--eval-every", "10"]
    run([py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), "-m", "ditorch.train",
         *common, "--loss-log", str(out / "run.jsonl"), "--save", str(out / "ckpt")], env, "4/7")
    run([py, "-m", "ditorch.train", *common, "--reference", "--quiet", "--loss-log", str(out / "reference.jsonl")],
        env, "5/7")
    verdict = run([*ditorch, "mre", str(out / "reference.jsonl"), str(out / "run.jsonl"), "--threshold", "1.5",
                   "--plot", str(out / "loss_curves.png")], env, "6/7", check=False)
    show_generation(out / "ckpt" / "hf")
    print(f"\nhf demo: {'PASS' if verdict == 0 else 'FAIL'} in {time.perf_counter() - started:.0f} s; outputs in "
          f"{out.relative_to(REPO)}")
    return verdict


if __name__ == "__main__":
    sys.exit(main())
