"""The int8 prefilter's GEMM: exact integer dot products of int8 query codes and int8 node codes, in
oneDNN by one of two routes (their rates: ``benchmarks/bench_gemm.py``, benchmarks/RESULTS.md):

- :class:`IntMm`, ``torch._int_mm``: int32 sums. Fast where the CPU has VNNI; without it, on an AMD
  EPYC Zen 2 or Zen 3 (AVX2 alone), it runs a reference loop at 4-5 GOP/s, 0.03x the float32 GEMM.
- :class:`QuantizedLinear`, oneDNN's matmul primitive through torch's x86 quantised linear layer
  (``torch.ops.onednn.qlinear_prepack`` / ``qlinear_pointwise``): the query codes shifted to uint8
  with zero point 128, every scale 1, float32 sums, exact while they stay below 2^24. 2.2x the
  float32 GEMM on that EPYC Zen 3.

:func:`for_this_cpu` picks one; :func:`node_code_max` decides the node codes it sums exactly."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..capabilities import cpu_has_vnni, require

FLOAT32_EXACT = 2**24  # integers a float32 holds exactly, all of them


class IntMm:
    """``torch._int_mm``: the node block as it is, int32 out, into a reused output tile."""

    name = "torch._int_mm"
    exact_below = 2**31

    def __init__(self):
        self.torch = require("torch")
        self.output_dtype = self.torch.int32

    def pack(self, nodes):
        """One block of node codes (cols, d), int8, as the GEMM takes it."""
        return nodes

    def tile(self, codes):
        """A tile of query codes (rows, d), int8, as the GEMM takes it."""
        return codes

    def __call__(self, tile, packed, out=None):
        return self.torch._int_mm(tile, packed.T, out=out)


class QuantizedLinear:
    """oneDNN's matmul primitive: the node block prepacked once (a copy in oneDNN's blocked layout), the
    query tile as uint8 codes + 128 with zero point 128, float32 out (a new tensor: no ``out=``)."""

    name = "oneDNN matmul (torch.ops.onednn.qlinear_pointwise)"
    exact_below = FLOAT32_EXACT

    def __init__(self):
        self.torch = require("torch")
        self.output_dtype = self.torch.float32
        self._ops = self.torch.ops.onednn
        self._unit_scales: dict[int, tuple[Any, Any]] = {}  # per block width: its scales (1) and zero points (0)

    @staticmethod
    def available() -> bool:
        torch = require("torch")
        return hasattr(torch.ops.onednn, "qlinear_pointwise") and hasattr(torch.ops.onednn, "qlinear_prepack")

    def pack(self, nodes):
        return self._ops.qlinear_prepack(nodes, None)

    def tile(self, codes):
        return codes.view(self.torch.uint8) ^ 0x80  # two's complement + 128: uint8 codes of zero point 128

    def __call__(self, tile, packed, out=None):
        cols = int(packed.size(1))  # the prepacked block is (d, cols)
        if cols not in self._unit_scales:
            self._unit_scales[cols] = (self.torch.ones(cols), self.torch.zeros(cols, dtype=self.torch.long))
        scales, zero_points = self._unit_scales[cols]
        return self._ops.qlinear_pointwise(
            tile, 1.0, 128, packed, scales, zero_points, None, 1.0, 0, self.torch.float32, "none", [], ""
        )


def for_this_cpu():
    """``torch._int_mm`` where the CPU has VNNI (measured fast there) or torch lacks oneDNN's quantised
    linear layer; oneDNN's matmul primitive elsewhere (AVX2 alone: 40-70x ``torch._int_mm`` on an EPYC Zen 3)."""
    return IntMm() if cpu_has_vnni() or not QuantizedLinear.available() else QuantizedLinear()


def node_code_max(gemm, dim: int) -> int:
    """The largest |int8 code| the nodes may take for ``gemm``'s sums to be exact at this dimension:
    127, or 63 where oneDNN's kernel adds u8 x s8 products in pairs into int16 and saturates past
    32,767 (without VNNI: an AVX-512 CPU capped to AVX2 did, as does the matmul route on an EPYC Zen 3;
    ``torch._int_mm`` on a real AVX2-only EPYC Zen 2 did not), at most 2 x 255 x 63 = 32,130 with nodes of
    7 bits (the query side becomes u8 by adding 128, so it keeps its 8 bits). 0 where even that is not
    exact. Decided by a test GEMM at first use, on the codes that saturate first, and by the largest
    sum the output type holds exactly."""
    key = (type(gemm), dim)
    if key not in _code_max:
        _code_max[key] = _test_gemm(gemm, dim)
    return _code_max[key]


_code_max: dict[tuple[type, int], int] = {}  # per route and dimension: one test GEMM per process


def _test_gemm(gemm, dim: int) -> int:
    torch = require("torch")
    for code_max in (127, 63):
        if dim * 127 * code_max >= gemm.exact_below:
            continue
        query = np.full((16, dim), 127, np.int8)
        query[8:, 1::2] = -127
        nodes = np.full((40, dim), code_max, np.int8)
        nodes[20:] *= -1
        nodes[10:30, ::2] *= -1
        got = gemm(gemm.tile(torch.from_numpy(query)), gemm.pack(torch.from_numpy(nodes))).numpy()
        if np.array_equal(got, query.astype(np.int64) @ nodes.T.astype(np.int64)):
            return code_max
    return 0
