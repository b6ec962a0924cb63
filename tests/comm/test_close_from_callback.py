"""A work's future callback runs on the transport thread that completed the op; it may abort the
process group or drop its last reference there (destroying the group, its communicator and the
very pair whose thread runs the callback). The pair's thread must go on safely: no use of freed
memory (`make test-asan` runs this under AddressSanitizer), no crash, no hang. Rank 0 is played at
the protocol level (tests/fake_rank0.py) so that the message completing the receive arrives with
a second one right behind it, in the same read: the thread has more to handle after the callback."""
from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from fake_rank0 import FakeRank0, frame, master_store, p2p_tag

ROOT = Path(__file__).resolve().parents[2]

RANK1 = """
import datetime, sys, threading, time, torch, dicomm
store = torch.distributed.TCPStore("127.0.0.1", int(sys.argv[1]), 2, is_master=False,
                                   timeout=datetime.timedelta(seconds=60))
for case, how in enumerate(["abort", "destroy"]):
    holder = [dicomm.ProcessGroupDicomm(torch.distributed.PrefixStore(f"case{case}", store), 1, 2, 30.0)]
    t = torch.zeros(4)
    work = holder[0].recv([t], 0, 5)
    called = threading.Event()
    def callback(fut, how=how):
        if how == "abort":
            holder[0].abort()
        holder.clear()  # "destroy": the group's last reference goes, on the transport thread
        called.set()
    work.get_future().then(callback)
    print("posted", flush=True)
    assert called.wait(20), "the callback did not run"
    time.sleep(0.5)  # the transport thread runs on after the callback
    print(how, t.tolist(), flush=True)
"""


@pytest.mark.timeout(120)
def test_a_callback_may_abort_or_destroy_the_group_on_the_transport_thread():
    store, port = master_store()
    env = dict(os.environ, PYTHONPATH=str(ROOT), DICOMM_TRANSPORT="tcp", DICOMM_TCP_STREAMS="2")
    rank1 = subprocess.Popen([sys.executable, "-c", RANK1, str(port)], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    lines = []
    held = []
    try:
        for case in range(2):
            lanes = FakeRank0(store, prefix=f"case{case}/").join()
            held += lanes
            assert rank1.stdout.readline().strip() == "posted", rank1.communicate(timeout=30)[1][-3000:]
            message = frame("inline", p2p_tag(5), 16, 6) + struct.pack("<4f", 1, 2, 3, 4)
            lanes[0].sendall(message + message)  # the second one is read after the callback
            lines.append(rank1.stdout.readline().strip())
        out, err = rank1.communicate(timeout=60)
    finally:
        for s in held:
            s.close()
        if rank1.poll() is None:
            rank1.kill()
    assert rank1.returncode == 0, f"rank 1 exited with {rank1.returncode}: {err[-3000:]}"
    assert lines == ["abort [1.0, 2.0, 3.0, 4.0]", "destroy [1.0, 2.0, 3.0, 4.0]"], (lines, err[-3000:])
