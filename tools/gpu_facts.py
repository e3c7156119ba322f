"""Environment facts for tools/gpu_check.sh: Python, torch, triton, CUDA, the GPU, the host, the link.

Writes one JSON object to the path given (and prints it). On CUDA it measures the host-to-device
copy rate from pinned and from pageable memory (the link offloaded experts cross), median of a
few copies of `--copy-mib` MiB. Off CUDA the device fields say there is none.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path


def nvidia_smi() -> dict:
    """Driver, GPU name, memory and power limit as nvidia-smi reports them (empty without it)."""
    query = "driver_version,name,memory.total,power.limit,pcie.link.gen.max,pcie.link.width.max"
    try:
        line = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return {}
    return dict(zip(query.split(","), (v.strip() for v in line.split(","))))


def copy_gbps(torch, mib: int, pinned: bool, repeats: int = 5) -> float:
    """Median GB/s (1e9 bytes/s) of host-to-device copies of `mib` MiB."""
    host = torch.empty(mib << 20, dtype=torch.uint8, pin_memory=pinned)
    device = torch.empty_like(host, device="cuda")
    device.copy_(host, non_blocking=pinned)  # warm-up
    torch.cuda.synchronize()
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        device.copy_(host, non_blocking=pinned)
        torch.cuda.synchronize()
        rates.append(host.numel() / (time.perf_counter() - started) / 1e9)
    return statistics.median(rates)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="JSON file to write")
    parser.add_argument("--copy-mib", type=int, default=256, help="size of each measured copy (default 256 MiB)")
    args = parser.parse_args()
    facts: dict = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
        "cpu_cores": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
    }
    import torch

    facts |= {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    try:
        import triton

        facts["triton"] = triton.__version__
    except ImportError as error:
        facts["triton"] = f"not importable: {error}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts |= {
            "gpu": props.name,
            "gpu_count": torch.cuda.device_count(),
            "compute_capability": f"{props.major}.{props.minor}",
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "bf16_supported": torch.cuda.is_bf16_supported(),
            "nvidia_smi": nvidia_smi(),
            "h2d_pinned_gbps": round(copy_gbps(torch, args.copy_mib, pinned=True), 2),
            "h2d_pageable_gbps": round(copy_gbps(torch, args.copy_mib, pinned=False), 2),
        }
    else:
        facts["gpu"] = None
    text = json.dumps(facts, indent=2)
    args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
