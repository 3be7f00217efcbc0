"""How many bytes one stored Adam moment of a block takes in each ``optimizer.moment_dtype``: the plan counts them
before anything is allocated (the host arena is sized to the byte).

The layout itself (codes, scales, their order) belongs to ``runtime.update.moment_formats``, which encodes and decodes it
and takes the formats, the block, the alignment and the byte count from here (``planning`` sits below ``update``):
one definition. tests/unit/runtime/planning/test_moment_plan.py checks the count against the buffers the store
really holds. Leaves out: encoding, decoding and the update (``runtime.update.moments``).
"""

from __future__ import annotations

from runtime.config.schema import MOMENT_DTYPES

QUANT_BLOCK = 2048  # values per int8 scale (as bitsandbytes' 8-bit optimizers: the scales cost 0.2%)
INT8_ALIGN = 64  # an int8 moment's buffer is a multiple of this many bytes (its fp32 scales stay aligned)


def stored_moment_nbytes(moment_dtype: str, sizes: list[int]) -> int:
    """Bytes of one moment (exp_avg or exp_avg_sq) of a block whose parameters have ``sizes`` elements, stored as
    ``moment_dtype``: fp32 4 a value, bf16 2, int8 one code a value, each parameter's codes padded to whole blocks
    of ``QUANT_BLOCK``, then an fp32 scale a block, the whole rounded up to ``INT8_ALIGN``."""
    if moment_dtype == "fp32":
        return 4 * sum(sizes)
    if moment_dtype == "bf16":
        return 2 * sum(sizes)
    if moment_dtype == "int8":
        blocks = sum(-(-size // QUANT_BLOCK) for size in sizes)
        return -(-(blocks * QUANT_BLOCK + 4 * blocks) // INT8_ALIGN) * INT8_ALIGN
    raise ValueError(f"moment_dtype {moment_dtype!r}: one of {', '.join(MOMENT_DTYPES)}")


def state_itemsize(moment_dtype: str) -> float:
    """Bytes a parameter of optimizer state, the fp32 master and both moments stored as ``moment_dtype`` (padding left
    out: what rates and advice count with; the plan counts each block's bytes exactly)."""
    moment = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0 + 4.0 / QUANT_BLOCK}[moment_dtype]
    return 4.0 + 2.0 * moment
