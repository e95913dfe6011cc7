"""glibc allocator settings for training on CPU devices: keep freed memory instead of faulting it back in.

    eval "$(python -m experiments.host_malloc)"     # exports them into this shell; then train or benchmark
    python -m experiments.train ...

XLA:CPU allocates every buffer of a step (activations, saved residuals, gradients) with malloc and frees it at
the end of the step. With glibc's defaults, a block that large is mmap'ed and unmapped again (above a threshold
that adapts only up to 32 MiB), and the threads that run the 8 virtual devices each use an arena of their own
whose freed tops are trimmed back to the kernel: every step the kernel hands the same memory back as fresh zeroed
pages, one page fault per 4 KiB. The settings below put every thread on the main arena, serve blocks up to 1 GiB
from it and never trim it, so the memory is reused from step to step, at the price of the process keeping its
peak (resident memory does not shrink after a large step).

Measured on the 2-core CI-class host, the 6 x 384 GPT of experiments/bench/bench_peers.py ("mid"), fsdp over 8
CPU devices, remat none, 25 steps: 213k page faults per step -> 18k, system time 12.1 s -> 1.8 s, step
1.50 s -> 1.30 s (median), peak resident memory 1.6 GB -> 2.6 GB. All three are needed: the arena setting alone
or with either threshold alone left 83k-305k faults per step. Full remat keeps less per step and gains less.

The settings are read when the process starts, so they have to be in the environment before Python starts
(this module prints them; `experiments/bench/bench_peers.py` and `bench_levers.py` set them for their children).
"""

from __future__ import annotations

import shlex

#: environment variable -> value: one arena (M_ARENA_MAX), blocks under 1 GiB from the heap (M_MMAP_THRESHOLD),
#: the heap's top never returned to the kernel below 4 GiB (M_TRIM_THRESHOLD); mallopt(3)
HOST_MALLOC: dict[str, str] = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_THRESHOLD_": str(2**30),
    "MALLOC_TRIM_THRESHOLD_": str(2**32),
}


def exports() -> str:
    """The shell lines that set HOST_MALLOC (for `eval`)."""
    return "\n".join(f"export {name}={shlex.quote(value)}" for name, value in HOST_MALLOC.items())


if __name__ == "__main__":
    print(exports())
