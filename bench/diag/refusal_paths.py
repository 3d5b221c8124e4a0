"""Device diagnostic for the bindings' refusals (issue 16; NOTES-gpu "LoRA, session 9"):
which way of raising from the CUDA extension reaches Python and which ends the process.
Each kind of `refusal_probe` runs in its own child Python (faulthandler on):
    0  TORCH_CHECK(cond, "one literal")             (runs 26-31: reached Python)
    1  TORCH_CHECK(cond, "pieces ", n, ...)         (c10::str; suspected: SIGSEGV)
    2  EXL3_CHECK(cond, "pieces ", n, ...)          (bindings_util.h; every binding now)
and the table says each child's exit status and the message's first line.
    python bench/diag/refusal_paths.py"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import sys
from exl3cli.ops import cuda_kernels
ext = cuda_kernels._extension()
try:
    ext.refusal_probe(int(sys.argv[1]))
except RuntimeError as error:
    print("RuntimeError:", str(error).splitlines()[0])
else:
    print("no exception")
"""
KINDS = {0: "TORCH_CHECK, one literal", 1: "TORCH_CHECK, c10::str pieces",
         2: "EXL3_CHECK, pieces"}


def probe(kind: int) -> tuple[int, str]:
    """(exit status, last line of output) of refusal_probe(kind) in a child."""
    done = subprocess.run([sys.executable, "-X", "faulthandler", "-c", CHILD, str(kind)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    lines = (done.stdout + done.stderr).strip().splitlines()
    return done.returncode, lines[-1] if lines else ""


def main() -> int:
    print("| kind | raised by | exit | output |")
    print("|---|---|---|---|")
    for kind, what in KINDS.items():
        code, line = probe(kind)
        print(f"| {kind} | {what} | {code} | {line[:100]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
