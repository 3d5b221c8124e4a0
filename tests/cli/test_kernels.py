"""`exl3 kernels` builds what can be built here and says why the rest cannot."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from exl3cli.ops import cpu_kernels


def _kernels(**env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exl3cli", "kernels"], capture_output=True,
                          text=True, timeout=600, env={**os.environ, **env})


def _rows(output: str) -> dict[str, str]:
    rows = {}
    for line in output.splitlines()[1:]:
        label, _, rest = line.partition("  ")
        rows[label.strip()] = rest.strip()
    return rows


def test_every_extension_gets_a_line_and_the_cpu_one_builds_where_it_can():
    result = _kernels()
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("kernel cache: ")
    rows = _rows(result.stdout)
    assert set(rows) == {"CPU kernels", "CUDA kernels", "CUDA Viterbi kernel"}
    # The same verdict as the library reaches in this process.
    cpu_ready = cpu_kernels.available()
    assert rows["CPU kernels"].startswith("ready" if cpu_ready else "unavailable")
    if not torch.cuda.is_available():
        assert rows["CUDA kernels"] == "unavailable  no CUDA GPU"


def test_no_ext_turns_every_extension_off_and_says_so():
    result = _kernels(EXL3_NO_EXT="1")
    assert result.returncode == 0, result.stderr
    rows = _rows(result.stdout)
    assert rows and all(row == "unavailable  EXL3_NO_EXT is set" for row in rows.values())
