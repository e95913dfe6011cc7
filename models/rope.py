"""RoPE's frequencies, with the scalings Hugging Face checkpoints use (GPTConfig.rope_scaling; models/hf)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from shardkit.errors import ShardkitError


def checked_scaling(scaling: tuple | list) -> tuple:
    """`GPTConfig.rope_scaling` as a tuple: (), ("linear", factor) or ("llama3", factor, low_freq_factor,
    high_freq_factor, original_max_position_embeddings); anything else is a ShardkitError."""
    scaling = tuple(scaling)
    kind, n = (scaling or ("",))[0], len(scaling)
    if scaling and not ((kind == "linear" and n == 2) or (kind == "llama3" and n == 5)):
        raise ShardkitError(
            f"rope_scaling={scaling!r}: give (), ('linear', factor) or ('llama3', factor, low_freq_factor, "
            "high_freq_factor, original_max_position_embeddings)"
        )
    return scaling


def rope_frequencies(half: int, theta: float, scaling: tuple, dtype: jnp.dtype) -> jax.Array:
    """The rotary frequencies theta^(-i/half), i < half, scaled as `GPTConfig.rope_scaling` says: "linear" divides
    them by the factor (positions interpolated, Chen et al. 2306.15595); "llama3" divides the low frequencies
    (wavelength > original length / low_freq_factor) by the factor, keeps the high ones (wavelength < original
    length / high_freq_factor) and blends those between (Llama 3, Dubey et al. 2407.21783; HF's `llama3` rope)."""
    freq = theta ** (-jnp.arange(half, dtype=dtype) / half)
    if not scaling:
        return freq
    factor = scaling[1]
    if scaling[0] == "linear":
        return freq / factor
    low, high, original = scaling[2:]
    wavelen = 2 * math.pi / freq
    scaled = jnp.where(wavelen > original / low, freq / factor, freq)
    smooth = (original / wavelen - low) / (high - low)
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return jnp.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
