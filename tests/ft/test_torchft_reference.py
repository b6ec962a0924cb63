"""torchft's own tests as the reference for ``dicomm.torchft_group.ProcessGroupDicommFT``.

The torchft wheel ships its tests (``torchft/*_test.py``); they are imported from it, never
copied. Each case chosen here runs twice: on torchft's ``ProcessGroupGloo`` (as shipped) and with
the dicomm group in its place, so what passes on gloo is seen to pass on dicomm
(docs/ft.md has the table of every device-generic case, this file the fast ones):

* ``process_group_test``: every collective over 3 ranks, and the ``with_resiliency`` cases (the
  last rank leaves, the others reconfigure, see their op fail and ``errored`` name an abort).
  The cases whose failure gloo only reports at its 30 s timeout are in the table, not here.
* ``manager_integ_test``: DDP through torchft's Manager between two replica groups, healthy and
  with the failure injector crashing one replica (it restarts, heals from the other and both end
  with equal parameters and optimizer state).
* ``local_sgd_integ_test``: DiLoCo between two replica groups.

The dicomm variants swap the name ``ProcessGroupGloo`` in the test module for the dicomm class
(the train loops build their group through that name) and nothing else.
"""
from __future__ import annotations

import os
import re
from datetime import timedelta
from unittest import mock

import pytest
from parameterized import parameterized
from torchft import local_sgd_integ_test, manager_integ_test, process_group_test
from torchft._test import diloco_trainer

import ditorch  # noqa: F401  (the dipu device, then dicomm registered for it as torch.distributed's default)
from dicomm.torchft_group import ProcessGroupDicommFT

# torchft's Manager servers bind fixed ports (19530 + replica id): one xdist worker runs them all.
pytestmark = pytest.mark.xdist_group("torchft")

# process_group_test's resiliency check names each backend's wording of "a peer left" (gloo's,
# NCCL's); dicomm's own words for it are added, nothing else about the check changes.
DICOMM_PEER_LEFT = r"|that rank shut down its process group|communicator aborted"

# FT_ALL_CASES=1 runs every device-generic case (the table in docs/ft.md; ~15 minutes on 2 cores).
ALL_CASES = os.environ.get("FT_ALL_CASES") == "1"

COLLECTIVES = sorted(process_group_test._ALL_COLLECTIVES)
# gloo has no reduce-scatter or all-to-all (torchft skips them for gloo too).
GLOO_COLLECTIVES = sorted(process_group_test.NormalGlooMultiPgTest.COLLECTIVES)
# gloo reports the loss of a peer in these only at its 30 s op timeout (docs/ft.md's table has them).
SLOW_ON_GLOO = {"allreduce", "allreduce_coalesced"}
RESILIENCY = sorted(set(GLOO_COLLECTIVES) - (set() if ALL_CASES else SLOW_ON_GLOO))
# dicomm reports it at once (the peer's goodbye), in the host's shared segment too.


class TestGlooProcessGroup(process_group_test.MultiPgBaseTest):
    """torchft's multi-rank process-group cases on its gloo group, as shipped."""

    BACKEND = "gloo"
    WORLD_SIZE = 3

    @parameterized.expand(GLOO_COLLECTIVES)
    def test_collective(self, collective: str) -> None:
        self._run_parallel(collective, device="cpu")

    @parameterized.expand(RESILIENCY)
    def test_collective_with_resiliency(self, collective: str) -> None:
        self._run_with_resiliency(collective, device="cpu")


class TestDicommProcessGroup(process_group_test.MultiPgBaseTest):
    """The same cases on the dicomm group, with the collectives gloo lacks as well."""

    BACKEND = "dicomm"
    WORLD_SIZE = 3

    @classmethod
    def _create_pg(cls, backend: str) -> ProcessGroupDicommFT:
        return ProcessGroupDicommFT(timeout=timedelta(seconds=1))  # gloo's timeout in the base class

    def assertRaisesRegex(self, expected_exception, expected_regex, *args, **kwargs):  # noqa: N802
        pattern = expected_regex.pattern if isinstance(expected_regex, re.Pattern) else expected_regex
        if pattern.startswith("(Connection closed by peer"):
            pattern = pattern[:-1] + DICOMM_PEER_LEFT + ")"
        return super().assertRaisesRegex(expected_exception, pattern, *args, **kwargs)

    @parameterized.expand(COLLECTIVES)
    def test_collective(self, collective: str) -> None:
        self._run_parallel(collective, device="cpu")

    @parameterized.expand(COLLECTIVES)
    def test_collective_with_resiliency(self, collective: str) -> None:
        self._run_with_resiliency(collective, device="cpu")


class _CountedDicomm(ProcessGroupDicommFT):
    """The dicomm group, counting the groups it made (a dicomm variant that made none would be
    testing something else)."""

    made = 0

    def _create_pg(self, store, rank, world_size):
        type(self).made += 1
        return super()._create_pg(store, rank, world_size)


# Cases that make no process group on the dicomm side either: the quorum never forms, or the
# case needs CUDA and is skipped.
MAKES_NO_GROUP = {"test_quorum_timeout", "test_manager_allreduce_0"}


class _Backend:
    """Mixin: run the inherited cases on ``BACKEND`` ('gloo' as shipped, or 'dicomm')."""

    BACKEND = "gloo"
    MODULES: tuple = ()

    def setUp(self) -> None:
        super().setUp()
        if self.BACKEND == "dicomm":
            counted = type("Dicomm", (_CountedDicomm,), {"made": 0})
            for module in self.MODULES:
                patch = mock.patch.object(module, "ProcessGroupGloo", counted)
                patch.start()
                self.addCleanup(patch.stop)
            # Cleanups run last-in first-out: this check runs after the test, before the unpatching.
            if self._testMethodName not in MAKES_NO_GROUP:
                self.addCleanup(lambda: self.assertGreater(counted.made, 0, "no dicomm group was made"))


class _Manager(_Backend, manager_integ_test.ManagerIntegTest):
    MODULES = (manager_integ_test,)


# The cases of each torchft class that run here (docs/ft.md's table has the others).
for _name in [n for n in dir(manager_integ_test.ManagerIntegTest) if n.startswith("test_")]:
    if not ALL_CASES and _name not in ("test_ddp_healthy", "test_ddp_recovery_0_async_quorum"):
        setattr(_Manager, _name, None)
_Manager.__test__ = False


class TestManagerGloo(_Manager):
    __test__ = True


class TestManagerDicomm(_Manager):
    __test__ = True
    BACKEND = "dicomm"


class _LocalSGD(_Backend, local_sgd_integ_test.LocalSGDIntegTest):
    MODULES = (local_sgd_integ_test, diloco_trainer)


# DiLoCo's cases run with FT_ALL_CASES=1 only: in the full suite its trainer's fixed ports (19530
# and up) were once taken, and its init_process_group (no backend named) met another module's
# dipu accelerator, on gloo as on dicomm.
for _name in [n for n in dir(local_sgd_integ_test.LocalSGDIntegTest) if n.startswith("test_")]:
    if not ALL_CASES:
        setattr(_LocalSGD, _name, None)
_LocalSGD.__test__ = False


class TestDiLoCoGloo(_LocalSGD):
    __test__ = True


class TestDiLoCoDicomm(_LocalSGD):
    __test__ = True
    BACKEND = "dicomm"
