"""DITORCH_EMU_PROTECT_MEMORY=1: dipu memory is closed to host code outside the vendor's kernels,
as an accelerator's is. Host code that reads a dipu pointer crashes (it works without protection,
so the crash is the protection's), and everything that goes through the device (kernels, copies,
the chip's numerics, autocast training, the device tests) gives bit-for-bit what it gives
unprotected. Each case runs in its own process: the setting is read once, at start-up."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

READ_DEVICE_POINTER = """
import ctypes, torch, ditorch
t = torch.arange(4.0, device="dipu") * 2 + 1   # a kernel wrote it
print("addressable", torch.dipu.is_host_addressable(), "values", t.cpu().tolist(), flush=True)
print("host read", ctypes.c_float.from_address(t.data_ptr() + 4).value, flush=True)
"""

TRAIN = """
import json, torch, ditorch
from dimodel.llama import Llama, LlamaConfig
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=128, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)
model = Llama(cfg).to("dipu")
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
tokens = torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(1)).to("dipu")
losses = []
for _ in range(4):
    with torch.autocast("dipu", dtype=torch.bfloat16):
        logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
print(json.dumps({"losses": losses, "weight": model.head.weight.float().sum().item()}))
"""


def _python(code: str, protect: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "DITORCH_EMU_PROTECT_MEMORY": protect, **env}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=240)


def test_host_read_of_device_memory_crashes_only_when_protected():
    unprotected = _python(READ_DEVICE_POINTER, "0")
    assert unprotected.returncode == 0, unprotected.stderr
    assert "addressable True values [1.0, 3.0, 5.0, 7.0]" in unprotected.stdout
    assert "host read 3.0" in unprotected.stdout

    protected = _python(READ_DEVICE_POINTER, "1")
    # The device path still works; the host's direct read is what dies, as on an accelerator.
    assert "addressable False values [1.0, 3.0, 5.0, 7.0]" in protected.stdout, protected.stderr
    assert "host read" not in protected.stdout
    assert protected.returncode == -signal.SIGSEGV, (protected.returncode, protected.stderr[-2000:])


@pytest.mark.slow
@pytest.mark.parametrize("chip", ["host", "D"])
def test_training_is_bit_identical_with_memory_protected(chip):
    """Chip D exercises every numerics path (recomputed matmuls, truncated casts, flushed
    denormals, reduced special functions) on protected memory."""
    runs = {protect: _python(TRAIN, protect, DITORCH_CHIP=chip) for protect in ("0", "1")}
    for protect, run in runs.items():
        assert run.returncode == 0, f"DITORCH_EMU_PROTECT_MEMORY={protect}: {run.stderr[-3000:]}"
    assert runs["1"].stdout.splitlines()[-1] == runs["0"].stdout.splitlines()[-1]


@pytest.mark.slow
def test_device_tests_pass_with_memory_protected():
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "tests/device/test_device.py",
                          "tests/device/test_device_refusals.py"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "DITORCH_EMU_PROTECT_MEMORY": "1"})
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout


def test_a_bad_setting_is_named():
    run = _python("import torch, ditorch; torch.ones(1, device='dipu')", "yes")
    assert run.returncode != 0
    assert "DITORCH_EMU_PROTECT_MEMORY=yes is invalid; expected 0 or 1" in run.stderr
