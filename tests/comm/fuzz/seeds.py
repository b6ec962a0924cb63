"""Writes the stream-frame fuzzer's seed corpus: well-formed conversations a real rank 0 could
have with rank 1 (tests/comm/fuzz/stream_frames_fuzzer.cpp explains the input layout), from the
wire format re-implemented in tests/fake_rank0.py. libFuzzer mutates from these."""
from __future__ import annotations

import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fake_rank0 import frame, p2p_tag  # noqa: E402

FLOAT = 6
TAG5, TAG6 = p2p_tag(5), p2p_tag(6)
PAYLOAD = struct.pack("<4f", 1, 2, 3, 4)


def case(posts: int, main: bytes, lane: bytes = b"") -> bytes:
    body = main + lane
    split = 255 if not lane else max(0, min(255, round(255 * len(main) / len(body))))
    # The harness splits at len(body) * split // 255; nudge until it falls on the boundary.
    while split < 255 and len(body) * split // 255 < len(main):
        split += 1
    return bytes([posts, split]) + body


SEEDS = {
    "inline-posted": case(1, frame("inline", TAG5, 16, FLOAT) + PAYLOAD),
    "inline-unexpected": case(0, frame("inline", TAG5, 16, FLOAT) + PAYLOAD),
    "inline-any-source": case(4, frame("inline", TAG5, 16, FLOAT) + PAYLOAD),
    "rts-data": case(1, frame("rts", TAG5, 16, FLOAT, seq=1) + frame("data", TAG5, 16, FLOAT, seq=1) + PAYLOAD),
    "rts-parts": case(2, frame("rts", TAG6, 2 << 20, FLOAT, seq=1) + frame("part", TAG6, 8, FLOAT, seq=1) + b"x" * 8,
                      frame("part", TAG6, 8, FLOAT, address=8, seq=1) + b"y" * 8),
    "rts-twice": case(5, frame("rts", TAG5, 16, FLOAT, seq=1) + frame("rts", TAG5, 16, FLOAT, seq=1)),
    "goodbye": case(1, frame("inline", TAG5, 16, FLOAT) + PAYLOAD + frame("goodbye")),
    "abort-notice": case(1, frame("inline", 3 << 60, 5) + b"cause"),
    "ack-cts": case(0, frame("ack", seq=3) + frame("cts", seq=4)),
    "remote": case(1, frame("remote", TAG5, 16, FLOAT, address=4096, seq=1)),
}

if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name, data in SEEDS.items():
        (out / f"seed-{name}").write_bytes(data)
