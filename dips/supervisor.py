"""The leader's process supervisor: launches the followers it was told to run and relaunches one
that stopped answering, from its latest checkpoint.

Every path and secret file it uses comes from the leader's own configuration; nothing a peer
sends over the network becomes part of a command line. A follower started by someone else is
that someone's to restart (systemd, Kubernetes, a shell loop): the leader only reports it.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
from pathlib import Path

log = logging.getLogger("dips.supervisor")


@dataclasses.dataclass(frozen=True)
class FollowerLaunch:
    """How to run follower ``index``: its data address and checkpoint directory."""

    index: int
    bind: str
    checkpoint_dir: str


class FollowerSupervisor:
    def __init__(self, launches: list[FollowerLaunch], leader_address: str, server_token_file: str,
                 extra_args: list[str] = ()):
        self.launches = {f.index: f for f in launches}
        self.leader_address, self.server_token_file = leader_address, server_token_file
        self.extra_args = list(extra_args)
        self.children: dict[int, subprocess.Popen] = {}

    def manages(self, index: int) -> bool:
        return index in self.launches

    def start_all(self, known: set[int]) -> None:
        """Launch every follower not in ``known``: a restarted leader adopts the followers its
        metadata lists (they heartbeat) and relaunches only those that stay silent."""
        for index in self.launches:
            if index not in known:
                self.start(index)

    def start(self, index: int) -> None:
        """(Re)launch follower ``index``; it resumes from its latest checkpoint, if any."""
        f = self.launches[index]
        old = self.children.get(index)
        if old is not None and old.poll() is None:
            old.kill()
            old.wait()
        cmd = [sys.executable, "-m", "dips.cli", "follower", "--leader", self.leader_address, "--bind", f.bind,
               "--server-token-file", self.server_token_file, "--checkpoint-dir", f.checkpoint_dir,
               "--index", str(index), *self.extra_args]
        repo = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
        self.children[index] = subprocess.Popen(cmd, env=env)
        log.info("follower %d launched (data %s, checkpoints %s)", index, f.bind, f.checkpoint_dir)

    def stop(self) -> None:
        for child in self.children.values():
            child.terminate()
        for child in self.children.values():
            try:
                child.wait(timeout=5)
            except subprocess.TimeoutExpired:
                child.kill()
