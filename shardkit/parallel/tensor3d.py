"""AxoNN's 3D tensor-parallel linear layer (x = `col`, y = `row`, z = `depth`) times data parallelism = 4D.

    y = sk.tensor3d.linear(x, w, mesh=mesh)                   # x [b, ..., k], w [k, n] -> y [b, ..., n]
    z = sk.tensor3d.linear(y, w2, mesh=mesh, transpose=True)  # FC1 -> FC2 without any re-layout

Singh et al., "A 4D hybrid algorithm to scale parallel training to thousands of GPUs" (2305.13525, §4) and
"Democratizing AI: open-source scalable LLM training on GPU-based supercomputers" (2502.08145): with
G = G_x G_y G_z G_d devices and a layer y = x @ w (x: m x k, w: k x n, m = tokens),

    x block  [m / (G_d G_z), k / G_x]        rows over (data, depth), columns over col, replicated over row
    w shard  [k / G_x, n / (G_y G_z)]        in-dim over col, out-dim over (row, depth): FSDP-like over depth
    y block  [m / (G_d G_z), n / G_y]        rows over (data, depth), columns over row, replicated over col

forward:  w_loc = all_gather_depth(w);  y = all_reduce_col(x_loc @ w_loc)
backward: w_loc = all_gather_depth(w);  dx = all_reduce_row(dy @ w_locᵀ);
          dw = all_reduce_data(reduce_scatter_depth(x_locᵀ @ dy))
`transpose=True` swaps the roles of col and row (in-dim over row, out-dim over (col, depth), y over col), which
is exactly the output layout of the untransposed layer: alternating layers chain with no communication. The
backward pass is a `custom_vjp` whose two `shard_map` kernels issue exactly these collectives, so the cost
model (`shardkit.costmodel.tp3d_layer_bytes`) predicts the compiled HLO. Mesh axes that are absent count as 1.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardkit.errors import ShardkitError
from shardkit.strategies import Strategy, register_strategy, table

AXES_4D = ("data", "row", "col", "depth")


@dataclasses.dataclass(frozen=True)
class Grid:
    """(G_x, G_y, G_z, G_d) of a mesh: degrees of col, row, depth, data (1 where the axis is absent)."""

    gx: int
    gy: int
    gz: int
    gd: int

    @classmethod
    def of(cls, mesh: Mesh) -> Grid:
        check_mesh(mesh)
        return cls(*(mesh.shape.get(a, 1) for a in ("col", "row", "depth", "data")))

    @property
    def size(self) -> int:
        return self.gx * self.gy * self.gz * self.gd


def check_mesh(mesh: Mesh) -> None:
    """A 4D mesh has only data/row/col/depth axes of size > 1 and at least one of row/col/depth."""
    extra = [a for a, n in mesh.shape.items() if n > 1 and a not in AXES_4D]
    if extra or not {"row", "col", "depth"} & set(mesh.shape):
        raise ShardkitError(
            f"tensor3d needs a mesh over {', '.join(AXES_4D)} (any may be 1 or absent, but at least one of "
            f"row/col/depth must exist), got {dict(mesh.shape)}; e.g. sk.make_mesh('data=2,depth=1,row=2,col=2')"
        )


@dataclasses.dataclass(frozen=True)
class _Layout:
    mesh: Mesh
    in_axis: str | None  # mesh axis of x's last dim / w's first dim (col, or row when transposed)
    out_axis: str | None  # mesh axis of y's last dim (row, or col when transposed)
    depth: str | None
    data: str | None
    ndim: int  # of x

    def _ax(self, *names: str | None) -> str | tuple[str, ...] | None:
        kept = tuple(n for n in names if n is not None)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    @property
    def x(self) -> P:
        return P(self._ax(self.data, self.depth), *([None] * (self.ndim - 2)), self._ax(self.in_axis))

    @property
    def w(self) -> P:
        return P(self._ax(self.in_axis), self._ax(self.out_axis, self.depth))

    @property
    def y(self) -> P:
        return P(self._ax(self.data, self.depth), *([None] * (self.ndim - 2)), self._ax(self.out_axis))


def _layout(mesh: Mesh, transpose: bool, ndim: int) -> _Layout:
    present = lambda a: a if mesh.shape.get(a, 1) > 1 else None
    ins, outs = ("row", "col") if transpose else ("col", "row")
    return _Layout(mesh, present(ins), present(outs), present("depth"), present("data"), ndim)


def specs(mesh: Mesh, transpose: bool = False, ndim: int = 2) -> tuple[P, P, P]:
    """(x, w, y) PartitionSpecs of a layer on `mesh`; place w with NamedSharding(mesh, specs(...)[1])."""
    check_mesh(mesh)
    lay = _layout(mesh, transpose, ndim)
    return lay.x, lay.w, lay.y


def weight_sharding(mesh: Mesh, transpose: bool = False) -> NamedSharding:
    """Where a [k, n] weight rests: in-dim over col (row), out-dim over (row, depth) ((col, depth))."""
    return NamedSharding(mesh, specs(mesh, transpose)[1])


def _check(x: jax.Array, w: jax.Array, mesh: Mesh, transpose: bool) -> None:
    g = Grid.of(mesh)
    gin, gout = (g.gy, g.gx) if transpose else (g.gx, g.gy)
    names = ("row", "col") if transpose else ("col", "row")
    if x.ndim < 2 or w.ndim != 2 or x.shape[-1] != w.shape[0]:
        raise ShardkitError(f"tensor3d.linear: needs x [b, ..., k] and w [k, n], got x {x.shape} and w {w.shape}")
    for size, degree, what in (
        (x.shape[0], g.gd * g.gz, "x's leading (batch) dimension over data x depth (G_d G_z)"),
        (w.shape[0], gin, f"the input dimension k over {names[0]}"),
        (w.shape[1], gout * g.gz, f"the output dimension n over {names[1]} x depth"),
    ):
        if size % degree:
            raise ShardkitError(
                f"tensor3d.linear(transpose={transpose}) on grid G_x={g.gx}, G_y={g.gy}, G_z={g.gz}, G_d={g.gd}: "
                f"{what} is {size}, not divisible by {degree}; choose sizes divisible by {degree} or smaller degrees"
            )


def _gather_w(w: jax.Array, lay: _Layout) -> jax.Array:
    """w shard [k/G_in, n/(G_out G_z)] -> w_loc [k/G_in, n/G_out] (all-gather over depth)."""
    return w if lay.depth is None else lax.all_gather(w, lay.depth, axis=1, tiled=True)


def _psum(x: jax.Array, axis: str | None) -> jax.Array:
    return x if axis is None else lax.psum(x, axis)


def _fwd_kernel(lay: _Layout, x: jax.Array, w: jax.Array) -> jax.Array:
    # x: [m/(G_d G_z), ..., k/G_in]   w: [k/G_in, n/(G_out G_z)]
    y = jax.lax.dot_general(x, _gather_w(w, lay), (((x.ndim - 1,), (0,)), ((), ())))
    return _psum(y, lay.in_axis)  # y: [m/(G_d G_z), ..., n/G_out]


def _bwd_kernel(lay: _Layout, x: jax.Array, w: jax.Array, dy: jax.Array) -> tuple[jax.Array, jax.Array]:
    w_loc = _gather_w(w, lay)  # re-gathered, not saved: the memory AxoNN's depth axis exists to save
    dx = _psum(dy @ w_loc.T, lay.out_axis)  # [m/(G_d G_z), ..., k/G_in]
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    dw = x2.T @ dy2  # [k/G_in, n/G_out], partial over the rows this device holds
    if lay.depth is not None:
        dw = lax.psum_scatter(dw, lay.depth, scatter_dimension=1, tiled=True)
    return dx.astype(x.dtype), _psum(dw, lay.data).astype(w.dtype)


@functools.lru_cache(maxsize=256)
def _make(lay: _Layout) -> jax.custom_vjp:
    fwd_map = jax.shard_map(
        functools.partial(_fwd_kernel, lay), mesh=lay.mesh, in_specs=(lay.x, lay.w), out_specs=lay.y
    )
    bwd_map = jax.shard_map(
        functools.partial(_bwd_kernel, lay), mesh=lay.mesh, in_specs=(lay.x, lay.w, lay.y), out_specs=(lay.x, lay.w)
    )

    @jax.custom_vjp
    def f(x: jax.Array, w: jax.Array) -> jax.Array:
        return fwd_map(x, w)

    def f_fwd(x: jax.Array, w: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        return fwd_map(x, w), (x, w)

    def f_bwd(res: tuple[jax.Array, jax.Array], dy: jax.Array) -> tuple[jax.Array, jax.Array]:
        return bwd_map(*res, dy)

    f.defvjp(f_fwd, f_bwd)
    return f


def linear(x: jax.Array, w: jax.Array, *, mesh: Mesh, transpose: bool = False) -> jax.Array:
    """x [b, ..., k] @ w [k, n] -> [b, ..., n] with AxoNN's 4D placement (see the module docstring).

    Inputs in another layout are resharded on entry (by GSPMD, outside the kernel); keep w in
    `weight_sharding(mesh, transpose)` and x in `specs(mesh, transpose, x.ndim)[0]` to avoid that.
    Raises ShardkitError for a mesh without the 4D axes and for dimensions the grid does not divide.
    """
    _check(x, w, mesh, transpose)
    if math.prod(mesh.shape.values()) == 1:
        return x @ w
    return _make(_layout(mesh, transpose, x.ndim))(x, w)


# ------------------------------------------------------------------------------------------------------------
# The tp3d strategy, AxoNN 4D (Singh et al. 2305.13525) as rules: tokens over data x depth, the residual
# stream's embed over col, heads / mlp / vocab over row; weights additionally split over depth (FSDP-like). GSPMD
# compiles the projections to AxoNN's collectives: weight all-gathers over depth, output all-reduces over col
# (QKV, MLP-in) or row (attention-out, MLP-out: the "transposed" layers), input-gradient all-reduces over the
# other axis.
_TP3D = {"heads": "row", "kv_heads": "row", "mlp": "row", "vocab": "row"}
register_strategy(
    Strategy(
        "tp3d",
        table(embed=("col", "depth"), **_TP3D),
        table(batch=("data", "depth"), embed="col", **_TP3D),
        description="AxoNN 3D tensor (col x row x depth) x data: 4D; any of the four axes may be absent",
        collectives="per projection: AG of weights over depth, AR over col / row fwd and bwd; dW RS over depth,"
        " AR over data",
    )
)


__all__ = ["AXES_4D", "Grid", "check_mesh", "linear", "specs", "weight_sharding"]
