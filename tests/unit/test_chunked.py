"""Row-chunked embeddings and head (backends/chunked.py), in one process: the gathers are
simulated from the full weight, partitioned as FSDP2 (dim-0 rows) and DeepSpeed (flat) do."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardgen.backends.chunked import FlatWeight, chunk_rows, embedding_forward, linear_forward


class SimulatedWeight(FlatWeight):
    """A FlatWeight whose gather reads every rank's partition of ``full`` (no process group)."""

    def __init__(self, full: torch.Tensor, world: int, flat: bool, chunk_bytes: int) -> None:
        v, h = full.shape
        part = -(-v * h // world) if flat else -(-v // world) * h
        self.full = full
        super().__init__((v, h), part, lambda: None, None, full.dtype, chunk_bytes, world=world)
        self.gathers = 0

    def gather(self, c: int, device: torch.device) -> torch.Tensor:
        flat = torch.zeros(self.world * self.part, dtype=self.dtype)
        flat[: self.numel] = self.full.reshape(-1)
        parts = flat.view(self.world, self.part)
        n = self.size(c)
        self.gathers += 1
        return parts[:, c * self.piece : c * self.piece + n].reshape(-1)


CASES = [
    # (rows, cols, world, flat, chunk_bytes)
    (101, 32, 2, True, 1536),  # DeepSpeed: 50.5 rows per rank, every chunk boundary of rank 1 cuts a row
    (101, 32, 2, False, 1536),  # FSDP2: 51 rows per rank, the last rank padded
    (96, 16, 3, True, 700),
    (7, 5, 4, True, 1),  # one row per chunk; a row spans three ranks' partitions
    (10, 8, 3, False, 10**9),  # one chunk
    (3, 40, 8, True, 200),  # fewer rows than ranks
]


@pytest.mark.parametrize("rows,cols,world,flat,chunk_bytes", CASES)
def test_every_row_is_assembled_whole_exactly_once(rows, cols, world, flat, chunk_bytes):
    full = torch.randn(rows, cols)
    w = SimulatedWeight(full, world, flat, chunk_bytes)
    seen = torch.zeros(rows, dtype=torch.long)

    def check(first: int, block: torch.Tensor) -> None:
        assert torch.equal(block, full[first : first + block.shape[0]])
        seen[first : first + block.shape[0]] += 1

    w.for_each_rows(torch.device("cpu"), check)
    assert seen.tolist() == [1] * rows
    assert w.gathers == w.n_chunks == -(-w.part // w.piece)
    assert w.world * w.piece * 4 <= max(chunk_bytes, w.world * cols * 4)  # one row per rank at least


@pytest.mark.parametrize("rows,cols,world,flat,chunk_bytes", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_embedding_and_head_equal_the_whole_weight(rows, cols, world, flat, chunk_bytes, dtype):
    full = torch.randn(rows, cols).to(dtype)
    ids = torch.randint(0, rows, (3, 5))
    w = SimulatedWeight(full, world, flat, chunk_bytes)
    assert torch.equal(embedding_forward(w, ids), F.embedding(ids, full))
    x = torch.randn(3, 2, cols).to(dtype)
    # Each logit is the dot product of one whole row; BLAS may order its sums differently for a
    # block of rows than for the whole matrix (fp32 here: last bits), hence a tolerance.
    torch.testing.assert_close(linear_forward(w, x), F.linear(x, full))


def test_the_schedule_depends_on_shapes_only():
    """Every rank must issue the same gathers: their number and size come from the shape, dtype,
    group size and budget, never from the data (a 1x1 shadow input gathers what a batch does)."""
    full = torch.randn(50, 8)
    a = SimulatedWeight(full, 2, True, 300)
    embedding_forward(a, torch.zeros((1, 1), dtype=torch.long))
    b = SimulatedWeight(full, 2, True, 300)
    embedding_forward(b, torch.randint(0, 50, (4, 9)))
    assert a.gathers == b.gathers == a.n_chunks > 1
    assert chunk_rows(rows_per_rank=25, cols=8, itemsize=4, world=2, chunk_bytes=300) == 4
    assert chunk_rows(rows_per_rank=25, cols=8, itemsize=4, world=2, chunk_bytes=1) == 1
    assert chunk_rows(rows_per_rank=25, cols=8, itemsize=4, world=2, chunk_bytes=10**9) == 25
