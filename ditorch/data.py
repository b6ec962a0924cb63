"""``ditorch data``: training data. ``ditorch data prepare --tokenizer tokenizer.json text.txt
out.bin`` tokenizes text into a token file (``dimodel.token_file``) that ``ditorch.train --data``
reads; ``ditorch data info out.bin`` says what a token file holds."""
from __future__ import annotations

import argparse
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser("data", help="make and inspect token files for --data")
    sub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    prep = sub.add_parser("prepare", help="tokenize text files into a token file (with the tokenizers package)")
    prep.add_argument("--tokenizer", required=True, help="a tokenizers tokenizer.json (e.g. a Hugging Face model's)")
    prep.add_argument("--dtype", choices=("uint16", "uint32"), default=None,
                      help="token dtype (default: uint16 when the vocabulary fits, else uint32)")
    prep.add_argument("text", nargs="+", help="UTF-8 text files, then the output token file")
    prep.set_defaults(func=_prepare)
    info = sub.add_parser("info", help="tokens, dtype and largest id of a token file")
    info.add_argument("file")
    info.add_argument("--dtype", choices=("uint16", "uint32"), default=None)
    info.set_defaults(func=_info)


def _prepare(args: argparse.Namespace) -> int:
    from dimodel.token_file import prepare

    if len(args.text) < 2:
        print("ditorch data prepare: give the text file(s) and then the output file", file=sys.stderr)
        return 2
    *texts, out = args.text
    try:
        count = prepare(args.tokenizer, texts, out, args.dtype)
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for a bad tokenizer file
        print(f"ditorch data prepare: {exc}", file=sys.stderr)
        return 2
    print(f"{out}: {count:,} tokens from {len(texts)} file(s)")
    return 0


def _info(args: argparse.Namespace) -> int:
    import numpy as np

    from dimodel.token_file import TokenFile

    try:
        tokens = TokenFile(args.file, args.dtype)
    except (ValueError, OSError) as exc:
        print(f"ditorch data info: {exc}", file=sys.stderr)
        return 2
    top = max(int(np.max(tokens[lo:lo + (1 << 24)].numpy())) for lo in range(0, len(tokens), 1 << 24))
    print(f"{args.file}: {len(tokens):,} {tokens.dtype} tokens, largest id {top}")
    return 0
