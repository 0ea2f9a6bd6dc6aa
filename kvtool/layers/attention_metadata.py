"""What one forward step tells every attention layer about the flattened batch.

The step's new tokens are flattened into one dimension: the multi-token context chunks first,
then one token per remaining request (generating requests, and context chunks of a single token,
which attend exactly like a decode token). Request i owns query rows
``query_start_loc[i]:query_start_loc[i+1]``; its KV after the step spans ``seq_lens[i]`` tokens,
the last ``query_lens[i]`` of which are the new ones (causal mask aligned bottom-right).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    positions: torch.Tensor        # [num_tokens] int64, position of each new token in its sequence
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, prefix sums of query_lens
    query_lens: torch.Tensor       # [num_seqs] int32, new tokens per request
    seq_lens: torch.Tensor         # [num_seqs] int32, cached + new tokens per request
    block_tables: torch.Tensor     # [num_seqs, max_blocks_per_seq] int32, primary block ids, -1 padded
    slot_mapping: torch.Tensor     # [num_tokens] int64, block_id * tokens_per_block + offset of each new token
    tokens_per_block: int
    num_context_seqs: int          # these first requests use context attention; every later one has 1 new token
    max_query_len: int
    max_seq_len: int
    max_decode_seq_len: int | None = None  # longest one-token row's seq_len (decode grid); None: max_seq_len

    @property
    def num_seqs(self) -> int:
        return int(self.query_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])
