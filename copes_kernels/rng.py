"""The noise contract: Philox4x32-10 keyed by integers, turned into uniforms and Box–Muller normals.

Noise is a pure function of (seed, member, tensor_id, element index i), so the perturbation of a member and its
replay in the update agree on any backend, any rank, after any resume and under any chunking:

    key     = (seed & 0xffffffff, seed >> 32)
    counter = (q & 0xffffffff, q >> 32, member, tensor_id),  q = i >> 2
    x0..x3  = Philox4x32-10(counter, key)
    u_k     = (x_k >> 8) * 2^-24 + 2^-25                      (float32)
    n0, n1  = sqrt(-2 ln u0) * (cos, sin)(2 pi u1);  n2, n3 likewise from (u2, u3)
    eps(i)  = n_(i & 3)

This module is the host implementation of the contract (exact unsigned numpy arithmetic, results on any device); the
Triton twin lives in `backends/triton/rng.py` (the compiled CPU one in `backends/cpu/numerics.py`) and must produce
bit-identical words. One float32 detail: the largest word (x >> 8 = 2^24 - 1) rounds u to exactly 1.0
(ties-to-even); ln(1) = 0 gives a zero radius, never a NaN.
"""

from __future__ import annotations

import numpy as np
import torch

# Random123's Philox4x32 multipliers and Weyl key increments (Salmon et al., SC'11).
PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10

MASK32 = 0xFFFFFFFF
UINT64_MAX = (1 << 64) - 1
UNIFORM_SCALE = 2.0**-24  # 24 random bits fill a float32 mantissa exactly
UNIFORM_HALF_STEP = 2.0**-25  # centre each bucket so u is never 0
TWO_PI = 6.283185307179586

# Reserved member ids for streams that are not population noise (never reachable as a member index: the trainer
# rejects populations this large). They keep the partition and stochastic rounding independent of every eps.
PARTITION_STREAM = 0xFFFFFFFF
ROUNDING_STREAM = 0xFFFFFFFE


def _philox_rounds(c0, c1, c2, c3, k0, k1) -> tuple[np.ndarray, ...]:
    """The 10 rounds on uint64 arrays holding uint32 words: the 32x32-bit products fit exactly in 64 bits.

    Works in place on private contiguous copies of the (broadcast) counter words: no per-round allocations.
    """
    c0, c1, c2, c3 = (np.array(c, dtype=np.uint64) for c in np.broadcast_arrays(c0, c1, c2, c3, k0)[:4])
    m0, m1, low32, shift = np.uint64(PHILOX_M0), np.uint64(PHILOX_M1), np.uint64(MASK32), np.uint64(32)
    w0, w1 = np.uint64(PHILOX_W0), np.uint64(PHILOX_W1)
    p0, p1 = np.empty_like(c0), np.empty_like(c0)
    for _ in range(PHILOX_ROUNDS):
        np.multiply(c0, m0, out=p0)
        np.multiply(c2, m1, out=p1)
        # (c0, c1, c2, c3) <- (hi(p1) ^ c1 ^ k0, lo(p1), hi(p0) ^ c3 ^ k1, lo(p0))
        np.right_shift(p1, shift, out=c0)
        c0 ^= c1
        c0 ^= k0
        np.bitwise_and(p1, low32, out=c1)
        np.right_shift(p0, shift, out=c2)
        c2 ^= c3
        c2 ^= k1
        np.bitwise_and(p0, low32, out=c3)
        k0, k1 = (k0 + w0) & low32, (k1 + w1) & low32
    return c0, c1, c2, c3


def check_philox_inputs(counter: torch.Tensor, key: torch.Tensor) -> None:
    if counter.dtype != torch.int64 or key.dtype != torch.int64:
        raise ValueError("counter and key must be int64 tensors holding uint32 values, "
                         f"got {counter.dtype}, {key.dtype}")
    if counter.shape[-1:] != (4,) or key.shape[-1:] != (2,):
        raise ValueError("counter must be [..., 4] and key [..., 2], "
                         f"got {tuple(counter.shape)} and {tuple(key.shape)}")
    if bool(((counter < 0) | (counter > MASK32)).any()) or bool(((key < 0) | (key > MASK32)).any()):
        raise ValueError("counter and key words must lie in [0, 2^32)")


def philox4x32_10(counter: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Philox4x32-10 on int64 tensors holding uint32 values: counter [..., 4], key [..., 2] -> words [..., 4].

    Computed with numpy's unsigned arithmetic on the host (exact, and ~15x faster than int64 torch on CPU);
    leading dimensions broadcast; the words come back on counter's device.
    """
    check_philox_inputs(counter, key)
    c = counter.cpu().numpy().astype(np.uint64)
    k = key.cpu().numpy().astype(np.uint64)
    words = _philox_rounds(c[..., 0], c[..., 1], c[..., 2], c[..., 3], k[..., 0], k[..., 1])
    return torch.from_numpy(np.stack(words, axis=-1).astype(np.int64)).to(counter.device)


def check_stream_ids(seed: int, member: int, tensor_id: int) -> None:
    if not 0 <= int(seed) <= UINT64_MAX:
        raise ValueError(f"seed must be a uint64 (0 <= seed < 2^64), got {seed}")
    if not 0 <= int(member) <= MASK32:
        raise ValueError(f"member must be a uint32, got {member}")
    if not 0 <= int(tensor_id) <= MASK32:
        raise ValueError(f"tensor_id must be a uint32, got {tensor_id}")


# Host tile: 16K blocks keep each uint64 word array at 128 KB, so a tile's temporaries stay in L2 (about 2x
# faster than one pass over a large array).
HOST_TILE_BLOCKS = 1 << 14


def _tiles_of_words(first_block: int, num_blocks: int, *, seed: int, member: int, tensor_id: int):
    """Yield (start, (x0, x1, x2, x3)) for consecutive host tiles of counters q = first_block + start + ..."""
    check_stream_ids(seed, member, tensor_id)
    key0, key1 = np.uint64(int(seed) & MASK32), np.uint64(int(seed) >> 32)
    member_word, tensor_word = np.uint64(member), np.uint64(tensor_id)
    for start in range(0, num_blocks, HOST_TILE_BLOCKS):
        q = np.arange(first_block + start, first_block + min(start + HOST_TILE_BLOCKS, num_blocks), dtype=np.uint64)
        yield start, _philox_rounds(q & np.uint64(MASK32), q >> np.uint64(32), member_word, tensor_word, key0, key1)


def philox_blocks(
    first_block: int, num_blocks: int, *, seed: int, member: int, tensor_id: int,
    device: torch.device | str | None = None
) -> torch.Tensor:
    """Philox words [num_blocks, 4] (int64) for counters q = first_block .. first_block + num_blocks - 1."""
    out = np.empty((num_blocks, 4), dtype=np.uint64)
    for start, words in _tiles_of_words(first_block, num_blocks, seed=seed, member=member, tensor_id=tensor_id):
        for k, word in enumerate(words):
            out[start : start + word.size, k] = word
    return torch.from_numpy(out.view(np.int64)).to(device)


def _uniform(word: np.ndarray) -> np.ndarray:
    """uint32 words (in uint64) -> float32 uniforms (x >> 8) * 2^-24 + 2^-25, each step rounded in float32."""
    return (word >> np.uint64(8)).astype(np.float32) * np.float32(UNIFORM_SCALE) + np.float32(UNIFORM_HALF_STEP)


def _box_muller(u0: np.ndarray, u1: np.ndarray, u2: np.ndarray, u3: np.ndarray) -> tuple[np.ndarray, ...]:
    """(n0, n1, n2, n3) in float32: radius from u0 (u2), angle from u1 (u3).

    numpy rather than torch: its SIMD float32 log/cos/sin are ~2x faster on these cache-sized tiles, and it never
    spins up intra-op threads for them (on a busy machine torch's thread hand-offs made tiles 50x slower).
    """
    normals = []
    for u_radius, u_angle in ((u0, u1), (u2, u3)):
        radius = np.sqrt(np.float32(-2.0) * np.log(u_radius))
        angle = np.float32(TWO_PI) * u_angle
        normals += [radius * np.cos(angle), radius * np.sin(angle)]
    return tuple(normals)


def _as_words(words: torch.Tensor) -> np.ndarray:
    return words.cpu().numpy().astype(np.uint64)


def words_to_uniform(words: torch.Tensor) -> torch.Tensor:
    """uint32 words (in int64) -> float32 uniforms in (0, 1], on the words' device."""
    return torch.from_numpy(_uniform(_as_words(words))).to(words.device)


def words_to_normal(words: torch.Tensor) -> torch.Tensor:
    """Philox blocks [..., 4] -> Box–Muller normals [..., 4], float32, pairs (u0, u1) and (u2, u3)."""
    u = _uniform(_as_words(words))
    return torch.from_numpy(np.stack(_box_muller(*np.moveaxis(u, -1, 0)), axis=-1)).to(words.device)


def normal_stream(
    n: int, *, seed: int, member: int, tensor_id: int, offset: int = 0, device: torch.device | str | None = None
) -> torch.Tensor:
    """eps(offset), ..., eps(offset + n - 1) as a float32 tensor (the whole contract in one call)."""
    if n < 0 or offset < 0:
        raise ValueError(f"n and offset must be >= 0, got n={n}, offset={offset}")
    if n == 0:
        return torch.empty(0, dtype=torch.float32, device=device)
    first_block, last_block = offset >> 2, (offset + n - 1) >> 2
    num_blocks = last_block - first_block + 1
    normals = np.empty((num_blocks, 4), dtype=np.float32)
    # Converted tile by tile while the words are still in cache; never materialises the full word array.
    for start, words in _tiles_of_words(first_block, num_blocks, seed=seed, member=member, tensor_id=tensor_id):
        for k, normal in enumerate(_box_muller(*(_uniform(word) for word in words))):
            normals[start : start + normal.size, k] = normal
    start = offset - 4 * first_block
    return torch.from_numpy(normals.reshape(-1)[start : start + n]).to(device)
