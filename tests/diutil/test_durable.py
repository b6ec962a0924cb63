"""diutil.durable: a file is whole or unchanged after a write that fails, whatever the cause."""
import errno
import os
import subprocess
import sys
import textwrap

import pytest

from diutil.durable import write_atomic, write_bytes_atomic


def test_a_failed_write_leaves_the_previous_file_and_no_litter(tmp_path):
    target = tmp_path / "state.json"
    write_bytes_atomic(target, b"version 1")

    def fails_midway(tmp):
        tmp.write_bytes(b"half of version")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match=f"writing {target} failed: No space left on device") as info:
        write_atomic(target, fails_midway)
    assert info.value.errno == errno.ENOSPC
    assert target.read_bytes() == b"version 1" and sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_past_the_file_size_limit_the_write_fails_and_nothing_changes(tmp_path):
    """RLIMIT_FSIZE: the kernel refuses the bytes past the limit (EFBIG); the process lives on."""
    target = tmp_path / "big.bin"
    target.write_bytes(b"old")
    code = textwrap.dedent(f"""
        import errno, resource, sys
        from diutil.durable import write_bytes_atomic
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        try:
            write_bytes_atomic({str(target)!r}, b"x" * 100000)
        except OSError as exc:
            print("refused", exc.errno == errno.EFBIG, exc)
            sys.exit(0)
        sys.exit(3)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("refused True") and str(target) in out.stdout
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["big.bin"]
