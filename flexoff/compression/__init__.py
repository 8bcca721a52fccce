"""Group-wise 4-bit (also 2, 3 and 8-bit) compression of weights and KV cache.

See :mod:`flexoff.compression.codec` for the formula and :mod:`flexoff.compression.tensor` for
the storage layout.
"""

from .codec import dequantize, dequantize_chunks, quantize, triton_available
from .tensor import CompressedTensor, CompressionError, compressed_nbytes

__all__ = [
    "CompressedTensor",
    "CompressionError",
    "compressed_nbytes",
    "dequantize",
    "dequantize_chunks",
    "quantize",
    "triton_available",
]
