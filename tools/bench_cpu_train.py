"""CPU training throughput of a GPT-2 preset, BluTrain against PyTorch's CPU build: now the CPU mode of
tools/bench/gpt2.py, which this forwards to so that the logic lives in one tool.

    python tools/bench_cpu_train.py --preset tiny --batch-size 16 --seq-len 128 --steps 20
    # is python tools/bench/gpt2.py --device cpu --preset tiny --batch-size 16 --seq-len 128 --steps 20

``--out`` names a folder (bench_gpt2.json, .png and .txt are written there).
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.argv = [str(Path(__file__).parent / "bench" / "gpt2.py"), "--device", "cpu", *sys.argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")
