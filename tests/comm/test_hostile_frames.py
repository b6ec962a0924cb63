"""A peer that passes the handshake and then sends malformed frames: every header field out of
bounds, frames for transfers never asked for, a frame cut short (also while rank 1 is still making
its group), a control frame on a data lane.
Rank 0 is played at the protocol level (tests/fake_rank0.py); rank 1 is a real backend that runs
one group per case, each waiting for a 16-byte float receive from rank 0. Each case must fail
rank 1's group with an error naming rank 0 -- no crash, no hang, nothing delivered -- and a
fresh group in the same process works afterwards (the last, well-formed case)."""
from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from fake_rank0 import FRAME, KIND, FakeRank0, frame, master_store, p2p_tag

ROOT = Path(__file__).resolve().parents[2]
TAG = p2p_tag(5)
FLOAT = 6  # c10::ScalarType::Float
PAYLOAD = struct.pack("<4f", 1, 2, 3, 4)

RANK1 = """
import datetime, json, sys, torch, dicomm
store = torch.distributed.TCPStore("127.0.0.1", int(sys.argv[1]), 2, is_master=False,
                                   timeout=datetime.timedelta(seconds=60))
for case in range(int(sys.argv[2])):
    pg = dicomm.ProcessGroupDicomm(torch.distributed.PrefixStore(f"case{case}", store), 1, 2, 15.0)
    t = torch.zeros(4)
    try:
        pg.recv([t], 0, 5).wait()
        result = {"ok": t.tolist()}
    except Exception as e:
        result = {"error": str(e)}
    print(json.dumps(result), flush=True)
    del pg
"""


def _cut_short(main: socket.socket) -> None:
    main.sendall(frame("inline", TAG, 16, FLOAT)[:40])
    main.shutdown(socket.SHUT_WR)


def _rts_then_data_of_another_size(main: socket.socket) -> None:
    main.sendall(frame("rts", TAG, 16, FLOAT, seq=1))
    main.settimeout(10)
    cts = main.recv(FRAME.size, socket.MSG_WAITALL)
    kind, *_, seq = FRAME.unpack(cts)
    assert (kind, seq) == (KIND["cts"], 1), FRAME.unpack(cts)
    main.sendall(frame("data", TAG, 1 << 20, FLOAT, seq=1))


def _rts_announced_twice(main: socket.socket) -> None:
    main.sendall(frame("rts", TAG, 16, FLOAT, seq=1))
    main.settimeout(10)
    cts = main.recv(FRAME.size, socket.MSG_WAITALL)  # matched: rank 1 waits for its data
    assert FRAME.unpack(cts)[0] == KIND["cts"], FRAME.unpack(cts)
    main.sendall(frame("rts", TAG, 16, FLOAT, seq=1))


# name -> (what rank 0 sends after joining, a word rank 1's error must contain); a step is bytes
# for a lane, or a function of the main lane
CASES = {
    "unknown frame kind": ([(0, frame(99))], "unknown frame kind"),
    "size far beyond any buffer": ([(0, frame("inline", TAG, 1 << 62, FLOAT))], "DICOMM_MAX_MESSAGE_BYTES"),
    "dtype out of range": ([(0, frame("inline", TAG, 16, 1000) + PAYLOAD)], "no c10::ScalarType"),
    "unknown tag kind": ([(0, frame("inline", 7 << 60, 16, FLOAT) + PAYLOAD)], "unknown tag kind"),
    "p2p tag beyond 32 bits": ([(0, frame("inline", TAG | (1 << 40), 16, FLOAT) + PAYLOAD)], "beyond its 32"),
    "unknown control tag": ([(0, frame("inline", (3 << 60) | 1, 4) + b"junk")], "unknown control tag"),
    "data never asked for": ([(0, frame("data", TAG, 16, FLOAT, seq=9) + PAYLOAD)], "never asked for"),
    "part never asked for": ([(0, frame("part", TAG, 16, FLOAT, seq=9) + PAYLOAD)], "not expected"),
    "a payload frame on a data lane": ([(1, frame("inline", TAG, 16, FLOAT) + PAYLOAD)], "data lane"),
    "a frame cut short": ([_cut_short], "closed"),
    "data of another size than announced": ([_rts_then_data_of_another_size], "asked for 16"),
    "a sequence announced twice": ([_rts_announced_twice], "announced twice"),
    # Over tcp the pid rank 0 gave belongs to another host: never read a local process's memory.
    "a cross-memory frame over tcp": ([(0, frame("remote", TAG, 16, FLOAT, address=4096, seq=1))],
                                      "does not use cross-memory attach"),
    "an abort notice": ([(0, frame("inline", 3 << 60, 9) + b"out of it")], "out of it"),
}


# As CASES, but sent on the main lane as soon as it is admitted (FakeRank0.join's `first`):
# rank 1's pair starts with the frame waiting, and breaks while its group is still being made.
EARLY = {"a frame cut short while rank 1 makes its group": (_cut_short, "closed")}
WELL_FORMED = [(0, frame("inline", TAG, 16, FLOAT) + PAYLOAD)]


@pytest.mark.timeout(300)
def test_malformed_frames_fail_the_group_naming_the_peer_and_a_fresh_group_works():
    names = list(CASES) + list(EARLY)
    store, port = master_store()
    env = dict(os.environ, PYTHONPATH=str(ROOT), DICOMM_TRANSPORT="tcp", DICOMM_TCP_STREAMS="2")
    rank1 = subprocess.Popen([sys.executable, "-c", RANK1, str(port), str(len(names) + 1)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = {}
    try:
        for i, name in enumerate(names + ["well-formed"]):
            first = EARLY[name][0] if name in EARLY else None
            lanes = FakeRank0(store, prefix=f"case{i}/").join(first=first)
            steps = CASES[name][0] if name in CASES else [] if name in EARLY else WELL_FORMED
            for step in steps:
                if callable(step):
                    step(lanes[0])
                else:
                    lanes[step[0]].sendall(step[1])
            line = rank1.stdout.readline()
            assert line, f"rank 1 ended during case {name!r}: " + rank1.communicate(timeout=30)[1][-3000:]
            results[name] = json.loads(line)
            for s in lanes:
                s.close()
        rank1.communicate(timeout=60)
    finally:
        if rank1.poll() is None:
            rank1.kill()
    assert rank1.returncode == 0, f"rank 1 exited with {rank1.returncode}"
    assert results["well-formed"] == {"ok": [1.0, 2.0, 3.0, 4.0]}, results["well-formed"]
    bad = {}
    for name, (_, word) in (CASES | EARLY).items():
        error = results[name].get("error", "")
        if "rank 0" not in error or word not in error:
            bad[name] = results[name]
    assert not bad, json.dumps(bad, indent=1)


RANK1_LATE_RECEIVES = """
import datetime, json, sys, time, torch, dicomm
store = torch.distributed.TCPStore("127.0.0.1", int(sys.argv[1]), 2, is_master=False,
                                   timeout=datetime.timedelta(seconds=60))
pg = dicomm.ProcessGroupDicomm(store, 1, 2, 15.0)
store.wait(["announced"])  # both announcements are in before either receive is posted
time.sleep(0.5)
works = [pg.recv([torch.zeros(4)], 0, 5) for _ in range(2)]
results = []
for w in works:
    try:
        w.wait()
        results.append("ok")
    except Exception as e:
        results.append(str(e))
print(json.dumps(results), flush=True)
"""


@pytest.mark.timeout(120)
def test_a_sequence_announced_twice_before_its_receives_fails_the_second_receive():
    """Two announcements of one rendezvous sequence wait, unmatched, for receives; the first
    receive takes the sequence, the second must fail naming rank 0 (not wait forever)."""
    store, port = master_store()
    env = dict(os.environ, PYTHONPATH=str(ROOT), DICOMM_TRANSPORT="tcp", DICOMM_TCP_STREAMS="2")
    rank1 = subprocess.Popen([sys.executable, "-c", RANK1_LATE_RECEIVES, str(port)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lanes = FakeRank0(store).join()
        lanes[0].sendall(frame("rts", TAG, 16, FLOAT, seq=1) + frame("rts", TAG, 16, FLOAT, seq=1))
        store.set("announced", "1")
        out, err = rank1.communicate(timeout=60)
    finally:
        if rank1.poll() is None:
            rank1.kill()
    assert rank1.returncode == 0, err[-3000:]
    second = json.loads(out.strip().splitlines()[-1])[1]
    assert "rank 0" in second and "announced twice" in second, second
