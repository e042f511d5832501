"""Whether an environment (default: ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=1) makes
PyTorch's CPU float32 kernels round differently here: matmuls, sums and softmaxes of a few
shapes run in this process and in a child with the environment, compared bit for bit.
Exits 1 if nothing differs, for then a second test run under it would repeat the first.

    python3 .ci/summation_order.py [NAME=VALUE ...]
"""

from __future__ import annotations

import io
import os
import subprocess
import sys

import torch


def results() -> dict:
    gen = torch.Generator().manual_seed(0)
    out = {}
    for m, k, n in [(7, 33, 17), (64, 96, 48), (257, 512, 129)]:
        a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
        out[f"mm {m}x{k}x{n}"] = a @ b
    for n in (1000, 100003):
        x = torch.randn(64, n // 64 + 1, generator=gen)
        out[f"sum {n}"], out[f"sum rows {n}"] = x.sum(), x.sum(1)
        out[f"softmax {n}"] = torch.softmax(x, -1)
    return out


def main() -> int:
    if os.environ.get("_SUMMATION_ORDER_CHILD"):
        buf = io.BytesIO()
        torch.save(results(), buf)
        sys.stdout.buffer.write(buf.getvalue())
        return 0
    env_args = sys.argv[1:] or ["ATEN_CPU_CAPABILITY=default", "OMP_NUM_THREADS=1"]
    env = dict(os.environ, _SUMMATION_ORDER_CHILD="1")
    env.update(a.split("=", 1) for a in env_args)
    child = subprocess.run([sys.executable, __file__], env=env, capture_output=True,
                           check=True)
    theirs = torch.load(io.BytesIO(child.stdout))
    mine = results()
    changed = [k for k in mine if not torch.equal(mine[k], theirs[k])]
    print(f"{' '.join(env_args)}: {len(changed)} of {len(mine)} float32 results change bits"
          + (f" ({', '.join(changed)})" if changed else ""))
    return 0 if changed else 1


if __name__ == "__main__":
    sys.exit(main())
