"""How a decode step and a block of keys read the INT2 latent cache's rows (mla_attention.py
scores and merges them).

A segment's rows (bf16 sink, codes, bf16 window) are read in place on a GPU, where
`mx.quantized_matmul` reads 2-bit codes directly, and as dense rows elsewhere: codes
dequantized (rows.dequantize) and a BLAS matmul, because MLX's CPU quantized matmul runs at
about 2 GFLOP/s against about 100 for its float32 BLAS (measured on this machine,
docs/int2-latent-cache.md). A decode step (one query, no DSA selection) reads its segments
whole with one softmax (`decode_read`); on the CPU a segment longer than PIECE rows in pieces
of PIECE, each evaluated while its rows are in the core's cache, and with few heads each
segment's rows times the query's columns (ROWS_FIRST_HEADS).
"""

from __future__ import annotations

import mlx.core as mx

from .latent_cache import RotatedLatentCache
from .online_softmax import Merge

# How codes are read: None picks by device (quantized_matmul on a GPU, dequantize + BLAS on
# the CPU); "qmm" or "dequantize" forces one (the engine bench builds the GPU graph on a CPU
# to count its conversions; tests check both paths agree).
READ_CODES: str | None = None
# On the CPU a decode step reads a segment longer than this many rows in pieces of it, each
# piece's rows converted (bf16 to float32, or codes dequantized), scored and summed while they
# are in the core's cache, then merged (online softmax, evaluated piece by piece); read whole,
# a 32K context's float32 rows (64 MiB at DeepSeek-V3's width) go to memory and are read back
# twice. 0: segments whole (the bench flips it to measure the difference; tests check both
# give the same attention). The demo's segments are shorter: it is read as before.
PIECE = 2048
# On the CPU a decode step with at most this many heads scores each segment as rows @ q^T
# (its keys' rows times the query's columns) rather than q @ rows^T: OpenBLAS's product of a
# few query rows by a transposed block of more than ~300 keys is 2-4x slower than the other
# orientation (4 x 128 by 593 rows: 27 us against 9 here), and the softmax's concatenation
# turns the scores back for free. It pays up to 32 heads at a 512-wide latent (16 heads by
# 2,048 rows: 455 us against 574; 32: 727 against 800); from 64 heads the two cost the same
# and turning the scores back is not free. 0: always q @ rows^T (the bench flips it).
ROWS_FIRST_HEADS = 32


def read_with_qmm() -> bool:
    if READ_CODES is not None:
        return READ_CODES == "qmm"
    return mx.default_device().type != mx.DeviceType.cpu


def dense_rows(cache: RotatedLatentCache, kind: str, lat, pe, dtype):
    """A block's rows as dense (latent, rope) arrays of `dtype`, rotated latent."""
    if kind != "codes":
        return lat[0].astype(dtype), pe[0].astype(dtype)
    return (
        cache.codes_lat.decode(lat, cache.latent_dims, dtype),
        cache.codes_pe.decode(pe, cache.rope_dims, dtype),
    )


def segment(cache: RotatedLatentCache, kind, lat, pe, qr, qp, dtype, gpu: bool):
    """One segment's scores against the flat queries qr, qp (B, 1, H*L, d), and a function
    of its attention weights giving its share of the values: codes read in place by
    `quantized_matmul` on a GPU; elsewhere dense rows (bf16, or codes dequantized)."""
    if kind == "codes" and gpu:
        st_l, st_p = cache.codes_lat, cache.codes_pe
        g_l, g_p = st_l.group(cache.latent_dims), st_p.group(cache.rope_dims)
        s = mx.quantized_matmul(qr, *lat, transpose=True, group_size=g_l, bits=st_l.bits)
        if st_p.bits is None:
            s = s + qp @ pe[0].astype(dtype).swapaxes(-1, -2)
        else:
            s = s + mx.quantized_matmul(qp, *pe, transpose=True, group_size=g_p, bits=st_p.bits)

        def value(p):
            return mx.quantized_matmul(p, *lat, transpose=False, group_size=g_l, bits=st_l.bits)

        return s, value
    k_lat, k_pe = dense_rows(cache, kind, lat, pe, dtype)
    s = qr @ k_lat.swapaxes(-1, -2) + qp @ k_pe.swapaxes(-1, -2)
    return s, lambda p: p @ k_lat


def decode_read(cache: RotatedLatentCache, q_lat, q_pe):
    """`absorbed` for one query per step (L == 1, no DSA selection): its segments (bf16
    sink, codes, bf16 window) are exactly what the query sees, so there is no mask and no
    block to merge: each segment's scores, one softmax over all of them, each segment's share
    of the values. The online softmax's running max, rescaling and merge per segment (a dozen
    small ops each) and the blocks' Python are what this saves; the products are the same.
    q_lat (B, H, 1, r) rotated and scaled -> (B, H, 1, r)."""
    B, H = q_lat.shape[:2]
    dtype = q_lat.dtype
    gpu = read_with_qmm()
    segs = [(kind, lat, pe) for kind, _, lat, pe in cache.segments(1)]
    if not gpu and H <= ROWS_FIRST_HEADS and not _long(segs):
        scores, values = _rows_first(cache, segs, q_lat, q_pe, dtype)
    else:
        qr = q_lat.reshape(B, 1, H, -1)
        qp = q_pe.reshape(B, 1, H, -1)
        if not gpu and _long(segs):
            return _read_in_pieces(cache, segs, qr, qp, dtype).reshape(B, H, 1, -1)
        scores, values = [], []
        for kind, lat, pe in segs:
            s, value = segment(cache, kind, lat, pe, qr, qp, dtype, gpu)
            scores.append(s)
            values.append(value)
    if len(scores) == 1:
        out = values[0](mx.softmax(scores[0], axis=-1, precise=True))
    else:
        p = mx.softmax(mx.concatenate(scores, axis=-1), axis=-1, precise=True)
        out, a = None, 0
        for s, value in zip(scores, values):
            n = s.shape[-1]
            o = value(p[..., a : a + n])
            out, a = (o if out is None else out + o), a + n
    return out.reshape(B, H, 1, -1)


def _long(segs) -> bool:
    """A segment is longer than a piece: on the CPU the step reads in pieces."""
    return bool(PIECE) and any(lat[0].shape[2] > PIECE for _, lat, _ in segs)


def _rows_first(cache: RotatedLatentCache, segs, q_lat, q_pe, dtype):
    """Each segment's dense rows scored rows-first, (rows, r) @ (r, H), the query turned to
    columns once per step (`ROWS_FIRST_HEADS`); the scores come back as (B, 1, H, rows)
    views of those products, which `decode_read`'s concatenation lays out as it copies."""
    qrT = mx.contiguous(q_lat.transpose(0, 2, 3, 1))  # (B, H, 1, r) -> (B, 1, r, H)
    qpT = mx.contiguous(q_pe.transpose(0, 2, 3, 1))
    scores, values = [], []
    for kind, lat, pe in segs:
        if kind == "codes":  # the whole codes segment: through the buffers' aliases
            n = cache.codes_lat.length
            k_lat = cache.codes_lat.dense(0, n, cache.latent_dims, dtype)
            k_pe = cache.codes_pe.dense(0, n, cache.rope_dims, dtype)
        else:
            k_lat, k_pe = dense_rows(cache, kind, lat, pe, dtype)
        scores.append((k_lat @ qrT + k_pe @ qpT).swapaxes(-1, -2))
        values.append(lambda p, k_lat=k_lat: p @ k_lat)
    return scores, values


def _read_in_pieces(cache: RotatedLatentCache, segs, qr, qp, dtype):
    """`decode_read`'s attention with each segment cut into pieces of PIECE rows, merged by
    online softmax and evaluated piece by piece (`Merge.settle`: left lazy, MLX would compute
    every piece's rows before merging any). -> (B, 1, H, r)."""
    merge = Merge()
    for kind, lat, pe in segs:
        n = lat[0].shape[2]
        for a in range(0, n, PIECE):
            b = min(n, a + PIECE)
            pl = tuple(x[..., a:b, :] for x in lat)
            pp = tuple(x[..., a:b, :] for x in pe)
            s, value = segment(cache, kind, pl, pp, qr, qp, dtype, False)

            def piece_values(p, value=value):
                return value(p.astype(dtype)).astype(mx.float32)

            merge.add(s.astype(mx.float32), piece_values)
            merge.settle()
    return merge.result().astype(dtype)
