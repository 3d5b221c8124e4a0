"""torch's "No CUDA runtime is found" notice (a CUDA build of torch on a machine without
a GPU) never reaches a user: not on stderr of a real process, not in a log capture."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import torch

import exl3cli  # noqa: F401  (importing the package installs the filter)


def test_the_notice_is_dropped_and_other_records_are_kept(tmp_path, monkeypatch, caplog):
    from torch.utils import cpp_extension

    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.INFO):
        # What a CUDA build of torch runs at import when no GPU is present.
        assert cpp_extension._find_cuda_home() == str(tmp_path)
        logging.getLogger("torch.utils.cpp_extension").warning("a real build problem")
    assert "No CUDA runtime" not in caplog.text
    assert "a real build problem" in caplog.text


def test_a_real_process_prints_nothing_for_it(tmp_path):
    script = ("import exl3cli.cli\n"
              "from torch.utils import cpp_extension\n"
              "import torch\n"
              "torch.cuda.is_available = lambda: False\n"
              "print(cpp_extension._find_cuda_home())\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "CUDA_HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path)
    assert done.stderr == ""
