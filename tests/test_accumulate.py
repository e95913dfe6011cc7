"""Gradient accumulation (shardkit/accumulate.py): the strided split, the carried model state, fp32 sums.

The model-level parity of accumulation (GSPMD and SDP steps with microbatches against one device) is in
test_parity.py, test_any_model.py and test_sdp_compose.py; these check the function itself on toy inputs, exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from shardkit.accumulate import accumulate, split_microbatches


def test_split_is_strided_and_exact():
    x = jnp.arange(12 * 2).reshape(12, 2)
    micro = split_microbatches({"x": x}, 3)["x"]
    assert micro.shape == (3, 4, 2)
    for i in range(3):  # microbatch i holds rows i, i + 3, i + 6, ...
        np.testing.assert_array_equal(micro[i], x[i::3])


def test_means_over_microbatches_and_the_state_is_carried():
    """A linear loss: the mean of the microbatch gradients is the full batch's gradient; a counter in the model
    state is incremented once per microbatch, in order."""

    def grad_fn(p, state, b):
        loss_fn = lambda p: (jnp.mean(b @ p), ({"rows": jnp.float32(b.shape[0])}, state + 1))
        return jax.value_and_grad(loss_fn, has_aux=True)(p)

    p = jnp.array([1.0, -2.0, 0.5])
    batch = jax.random.normal(jax.random.key(0), (8, 3))
    (loss, (aux, state)), grads = jax.jit(lambda p, b: accumulate(grad_fn, p, jnp.int32(0), b, 4))(p, batch)
    np.testing.assert_allclose(loss, jnp.mean(batch @ p), rtol=1e-6)
    np.testing.assert_allclose(grads, batch.mean(axis=0), rtol=1e-6)
    assert int(state) == 4 and float(aux["rows"]) == 2.0


def test_bf16_gradients_are_summed_in_fp32():
    """16 microbatches each with gradient 1 + 2^-6 (exact in bf16). A bf16 running sum rounds once it passes 4
    (spacing 2^-5, then 2^-4 past 8) and ends at 16.125, a mean of 1 + 2^-7; summed in fp32 the mean is
    1 + 2^-6 again, exactly."""
    g = jnp.bfloat16(1 + 2**-6)

    def grad_fn(p, state, b):
        return (jnp.float32(0.0), ({}, state)), jnp.full_like(p, g)

    p = jnp.zeros((4,), jnp.bfloat16)
    _, grads = accumulate(grad_fn, p, (), jnp.zeros((16, 1)), 16)
    assert grads.dtype == jnp.bfloat16
    np.testing.assert_array_equal(grads, jnp.full((4,), g))
    acc = np.zeros((), jnp.bfloat16)  # what a bf16 accumulator gives: the test above would fail with one
    for _ in range(16):
        acc = (acc + np.asarray(g)).astype(jnp.bfloat16)
    assert float(acc) == 16.125 and float(acc / 16) != float(g)
