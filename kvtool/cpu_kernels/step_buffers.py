"""The CPU decoder's activation buffers for a step, one per name, shared by every layer (a layer's
buffer is read before the next layer writes the same one) and grown by doubling when a step has more
rows than any before; a step takes views of their first rows."""

from __future__ import annotations

import torch


class StepBuffers:
    """Named [rows, columns] buffers of one dtype (kvtool.cpu_kernels.decoder's workspace and the tile
    products' outputs)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._buffers: dict[str, torch.Tensor] = {}

    def rows(self, name: str, num_rows: int, num_columns: int) -> torch.Tensor:
        """The first num_rows rows of the buffer ``name`` [rows, num_columns] (valid until the next call
        for ``name`` that grows it)."""
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape[0] < num_rows or buffer.shape[1] != num_columns:
            capacity = max(num_rows, 2 * buffer.shape[0] if buffer is not None else 1)
            buffer = self._buffers[name] = torch.empty(capacity, num_columns, dtype=self.dtype)
        return buffer[:num_rows]
