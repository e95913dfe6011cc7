"""Pipeline schedules as data and the `layers="pipeline:..."` kernel names (stack.py beside this file runs them).

`schedule(p, m, v, kind)` is the [ticks, stages] table of a full step (GPipe: Huang et al. 2019, 1811.06965;
1F1B / PipeDream-Flush: Narayanan et al. 2021, 2006.09503; circular: Narayanan et al. 2021, 2104.04473 §2.2) from
which the kernels drive their tick loop and the tests measure the bubble and the activations in flight.
`parse` and `stage_cut` read a kernel name "pipeline:<schedule>[:<m>[:<v>]][@<n_0>,...,<n_p-1>]": the part after
"@" is the number of layers each stage holds (uneven stages; absent = L/p each).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from shardkit.errors import ShardkitError

IDLE, FWD, BWD = 0, 1, 2
SCHEDULES = ("gpipe", "1f1b", "circular")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """op/mb/chunk[tick, stage]: IDLE, FWD or BWD of microbatch mb on virtual stage (chunk) `chunk`."""

    kind: str
    stages: int
    microbatches: int
    virtual: int
    op: np.ndarray
    mb: np.ndarray
    chunk: np.ndarray

    @property
    def ticks(self) -> int:
        return self.op.shape[0]

    def bubble(self) -> float:
        """Idle fraction of the stage x tick slots (F and B one tick each, v ticks per full-stage pass)."""
        return float((self.op == IDLE).mean())

    def peak_in_flight(self) -> np.ndarray:
        """Per stage: max over ticks of forwards done minus backwards done (stored microbatch activations)."""
        live = np.cumsum(self.op == FWD, axis=0) - np.cumsum(self.op == BWD, axis=0)
        return live.max(axis=0) // self.virtual if self.virtual > 1 else live.max(axis=0)


def bubble_formula(p: int, m: int, v: int = 1) -> float:
    """GPipe and 1F1B (v = 1): (p-1)/(m+p-1); interleaved with v virtual stages: (p-1)/(v m+p-1)."""
    return (p - 1) / (v * m + p - 1)


def parse(name: str, p: int) -> tuple[str, int, int]:
    """'pipeline:1f1b:8' -> ('1f1b', 8, 1); 'pipeline:circular:8:2' -> ('circular', 8, 2) (a cut after '@' aside)."""
    parts = name.partition("@")[0].split(":")[1:]
    kind = parts[0] if parts else "gpipe"
    if kind not in SCHEDULES:
        raise ShardkitError(f"pipeline schedule {kind!r} (from {name!r}): choose one of {', '.join(SCHEDULES)}")
    try:
        m = int(parts[1]) if len(parts) > 1 else p
        v = int(parts[2]) if len(parts) > 2 else (2 if kind == "circular" else 1)
    except ValueError as e:
        raise ShardkitError(
            f"{name!r}: expected 'pipeline:<schedule>:<microbatches>[:<virtual>][@<layers per stage>]'"
        ) from e
    if kind != "circular" and v != 1:
        raise ShardkitError(f"{name!r}: virtual stages (v={v}) need the 'circular' schedule")
    return kind, m, v


def parse_cut(text: str, where: str = "stage_layers") -> tuple[int, ...]:
    """'3,5' -> (3, 5): the layers per stage, in stage order; every count a whole number >= 1."""
    try:
        cut = tuple(int(n) for n in str(text).split(","))
    except ValueError:
        cut = ()
    if not cut or min(cut) < 1:
        raise ShardkitError(
            f"{where}={text!r}: give the layers of each stage as whole numbers >= 1 separated by commas, e.g. '3,5' "
            "for 2 stages of 3 and 5 layers (the config's pipeline.stage_layers also takes '' = even and 'hetero')"
        )
    return cut


def stage_cut(name: str, p: int, num_layers: int) -> tuple[int, ...] | None:
    """The layers per stage of 'pipeline:1f1b:4@3,5' -> (3, 5), checked against the `p` stages and the stack's
    `num_layers`; None without '@' (the even cut, L/p each). The one place a cut is validated."""
    if "@" not in name:
        return None
    cut = parse_cut(name.partition("@")[2], f"{name!r}: stage layers")
    if len(cut) != p:
        raise ShardkitError(
            f"{name!r}: {len(cut)} stage layer counts {list(cut)} for {p} pipeline stages (mesh axis 'stage' = {p}): "
            "give one count per stage"
        )
    if sum(cut) != num_layers:
        raise ShardkitError(
            f"{name!r}: the stage layer counts {list(cut)} sum to {sum(cut)}, but the model stacks {num_layers} "
            "layers: make them sum to the layer count"
        )
    if parse(name, p)[0] == "circular":
        raise ShardkitError(
            f"{name!r}: uneven stages run with the gpipe and 1f1b schedules only; the circular schedule splits each "
            "stage into v equal chunks that go round the ring in turn, and every chunk would be padded to the largest "
            "chunk of the ring. Use pipeline:1f1b or pipeline:gpipe, or drop the '@' part"
        )
    return cut


def check_counts(kind: str, p: int, m: int, v: int) -> None:
    """Microbatches and virtual stages a schedule can run on p stages; a ShardkitError with the numbers if not."""
    if m < 1 or v < 1:
        raise ShardkitError(f"pipeline: microbatches={m} and virtual stages={v} must be >= 1")
    if kind == "1f1b" and m < p:
        raise ShardkitError(f"1f1b needs microbatches >= stages: got {m} microbatches for {p} stages")
    if kind == "circular" and v > 1 and m < p:
        raise ShardkitError(f"circular needs microbatches >= stages to refill the ring: got m={m} < p={p}")


def schedule(p: int, m: int, v: int = 1, kind: str = "gpipe") -> Schedule:
    """The (tick, stage) -> (op, microbatch, chunk) table of a full step (forward and backward)."""
    check_counts(kind, p, m, v)
    if kind == "1f1b":
        return _one_f_one_b(p, m)
    v = v if kind == "circular" else 1
    fwd_ticks = v * m + p - 1
    op, mb, ch = (np.zeros((2 * fwd_ticks, p), np.int32) for _ in range(3))
    for s in range(p):
        for j in range(v * m):  # forward: stage s handles (repeat r, microbatch i) at tick r m + i + s
            r, i = divmod(j, m)
            t = j + s
            op[t, s], mb[t, s], ch[t, s] = FWD, i, r
            tb = fwd_ticks + (v - 1 - r) * m + i + (p - 1 - s)  # backward: the mirror image
            op[tb, s], mb[tb, s], ch[tb, s] = BWD, i, r
    return Schedule(kind, p, m, v, op, mb, ch)


def _one_f_one_b(p: int, m: int) -> Schedule:
    """PipeDream-Flush order per stage, timed by simulation: an op runs once its inputs arrived a tick earlier."""
    orders = []
    for s in range(p):
        warm = min(p - 1 - s, m)
        seq = [(FWD, i) for i in range(warm)]
        for i in range(m - warm):
            seq += [(FWD, warm + i), (BWD, i)]
        seq += [(BWD, i) for i in range(m - warm, m)]
        orders.append(seq)
    done: dict[tuple[int, int, int], int] = {}  # (op, microbatch, stage) -> tick it ran
    pos, rows, t = [0] * p, [], 0
    while any(pos[s] < len(orders[s]) for s in range(p)):
        row = []
        for s in range(p):
            if pos[s] == len(orders[s]):
                row.append((IDLE, 0))
                continue
            o, i = orders[s][pos[s]]
            dep = (FWD, i, s - 1) if o == FWD else (BWD, i, s + 1) if s < p - 1 else (FWD, i, s)
            ready = (o == FWD and s == 0) or done.get(dep, t) < t
            row.append((o, i) if ready else (IDLE, 0))
        for s, (o, i) in enumerate(row):
            if o != IDLE:
                done[(o, i, s)] = t
                pos[s] += 1
        rows.append(row)
        t += 1
    arr = np.array(rows, np.int32)  # [ticks, p, 2]
    return Schedule("1f1b", p, m, 1, arr[..., 0], arr[..., 1], np.zeros_like(arr[..., 0]))
