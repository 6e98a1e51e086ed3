"""The multi-LoRA kernels (hookllm.kernels.triton_lora), run on the CPU by the Triton interpreter,
against the pure-torch reference (hookllm.kernels.reference) on tiny shapes; and the reference
against a per-token loop of ``x @ A.T @ B.T``."""

import pytest
import torch

from hookllm.kernels import reference, triton_lora

if torch.cuda.is_available():
    # There tests/gpu/test_kernels_gpu.py runs the compiled kernels.
    pytest.skip("CUDA machine: the GPU kernel tests cover these kernels", allow_module_level=True)

# Every output (and split-K partial) starts as NaN: an element nothing wrote cannot pass.
pytestmark = pytest.mark.usefixtures("poisoned_empty")

K, RANK, SLOTS = 64, 16, 3


def make_batch(rows: int, widths: tuple[int, ...], slot_of: list[int | None], dtype: torch.dtype = torch.float32,
               rank: int = RANK, seed: int = 0) -> dict:
    """Random activations and adapters; ``slot_of[t]`` is token t's slot (None: no adapter). The
    tokens are grouped by slot in shuffled order, and ``token_order`` runs past the slots' ranges
    with out-of-range indices, as CUDA-graph padding would."""
    gen = torch.Generator().manual_seed(seed)
    slice_starts = tuple(sum(widths[:i]) for i in range(len(widths) + 1))
    shuffled = torch.randperm(rows, generator=gen).tolist()
    groups = [[t for t in shuffled if slot_of[t] == slot] for slot in range(SLOTS)]
    counts = torch.tensor([len(group) for group in groups], dtype=torch.int32)
    x = torch.randn(rows, K, generator=gen)
    x[[t for t in range(rows) if slot_of[t] is None]] = float("nan")  # never read
    return dict(
        x=x.to(dtype),
        lora_a=(torch.randn(SLOTS, len(widths) * rank, K, generator=gen) / 8).to(dtype),
        lora_b=(torch.randn(SLOTS, slice_starts[-1], rank, generator=gen) / 4).to(dtype),
        y=torch.randn(rows, slice_starts[-1], generator=gen).to(dtype),
        slice_starts=slice_starts,
        token_order=torch.tensor(sum(groups, []) + [rows + 7] * 5, dtype=torch.int32),
        slot_starts=(torch.cumsum(counts, 0) - counts).to(torch.int32),
        slot_counts=counts,
    )


def grouping(batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return batch["token_order"], batch["slot_starts"], batch["slot_counts"]


def run(ops, batch: dict) -> torch.Tensor:
    """y after ``ops``' shrink then expand."""
    y = batch["y"].clone()
    shrunk = ops.lora_shrink(batch["x"], batch["lora_a"], *grouping(batch))
    ops.lora_expand(y, shrunk, batch["lora_b"], batch["slice_starts"], *grouping(batch))
    return y


def adapted_rows(batch: dict) -> torch.Tensor:
    starts, counts = batch["slot_starts"], batch["slot_counts"]
    return batch["token_order"][:int(starts[-1] + counts[-1])].long()


def assert_matches_reference(batch: dict, tol: float) -> torch.Tensor:
    """The kernels' y against the reference's (rows of adapted tokens) and the input's (the
    others, bit for bit); returns the kernels' y."""
    got, want = run(triton_lora, batch), run(reference, batch)
    rows = adapted_rows(batch)
    others = torch.ones(len(got), dtype=torch.bool)
    others[rows] = False
    assert torch.equal(got[others], batch["y"][others])
    torch.testing.assert_close(got[rows], want[rows], atol=tol, rtol=tol)
    return got


def test_kernels_run_under_the_interpreter():
    assert type(triton_lora._shrink_kernel).__name__ == "InterpretedFunction"


def test_reference_adds_x_times_a_times_b_to_each_adapted_token():
    """The independent check: a loop over tokens, in float64, of x[t] @ A[slot].T @ B[slot, slice].T."""
    slot_of = [2, None, 0, 0, 2, None, 1, 0]
    batch = make_batch(8, (32, 16, 16), slot_of, seed=1)
    got = run(reference, batch)
    want = batch["y"].double()
    for t, slot in enumerate(slot_of):
        if slot is None:
            continue
        starts = batch["slice_starts"]
        for i, (start, end) in enumerate(zip(starts, starts[1:])):
            a = batch["lora_a"][slot, i * RANK:(i + 1) * RANK].double()
            want[t, start:end] += batch["x"][t].double() @ a.T @ batch["lora_b"][slot, start:end].double().T
    assert torch.equal(got[[1, 5]], batch["y"][[1, 5]])
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_one_slot_for_every_token():
    batch = make_batch(24, (96,), [1] * 24)
    assert_matches_reference(batch, tol=1e-5)


def test_one_slot_over_several_token_tiles_and_column_steps():
    """Two tiles of 16 tokens; 96 columns in steps of 32, two per program (the last one's second step masked)."""
    batch = make_batch(24, (96,), [1] * 24)
    y = batch["y"].clone()
    shrunk = triton_lora.lora_shrink_with(batch["x"], batch["lora_a"], *grouping(batch),
                                          triton_lora.ShrinkConfig(block_m=16, block_k=32, splits=2))
    triton_lora.lora_expand_with(y, shrunk, batch["lora_b"], batch["slice_starts"], *grouping(batch),
                                 triton_lora.ExpandConfig(block_m=16, block_n=32, blocks_per_program=2))
    torch.testing.assert_close(y, run(reference, batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_tokens_spread_over_slots_leave_the_rows_of_tokens_without_adapter_untouched(dtype, tol):
    slot_of = [None, 0, 2, 1, None, 2, 2, 0, 1, None, 0, 2, 1, 1, None, 0, 2, None, 0, 1]
    assert_matches_reference(make_batch(20, (64,), slot_of, dtype=dtype), tol)


def test_fused_slices_of_unequal_widths_read_their_own_rank_columns():
    slot_of = [t % SLOTS for t in range(18)]
    batch = make_batch(18, (48, 16, 16), slot_of, rank=8)
    got = assert_matches_reference(batch, tol=1e-5)
    # Each slice's delta: zeroing slice 1's A leaves exactly slice 1's columns as the input's.
    batch["lora_a"][:, 8:16] = 0
    assert torch.equal(run(triton_lora, batch)[:, 48:64], batch["y"][:, 48:64])
    assert not torch.equal(got[:, 48:64], batch["y"][:, 48:64])


def test_a_step_without_adapters_leaves_y_unchanged():
    batch = make_batch(16, (48, 16, 16), [None] * 16)
    assert torch.equal(run(triton_lora, batch), batch["y"])


def test_split_k_partials_sum_to_the_product():
    """Three K ranges of two steps over four steps: the last range is empty and writes zeros."""
    batch = make_batch(20, (32, 32), [t % 2 for t in range(20)])
    config = triton_lora.ShrinkConfig(block_m=16, block_k=16, splits=3)
    partials = triton_lora.lora_shrink_with(batch["x"], batch["lora_a"], *grouping(batch), config)
    assert partials.shape == (3, 20, 2 * RANK)
    assert torch.equal(partials[2], torch.zeros_like(partials[2]))
    want = reference.lora_shrink(batch["x"], batch["lora_a"], *grouping(batch))
    torch.testing.assert_close(partials.sum(0), want[0], atol=1e-5, rtol=1e-5)


def test_expand_adds_into_a_row_strided_view():
    """y as the LoRA'd columns of a wider output (a fused projection's slice): the other columns keep their values."""
    batch = make_batch(12, (32,), [t % SLOTS for t in range(12)])
    wide = torch.randn(12, 80)
    y = wide[:, 40:72]
    y.copy_(batch["y"])
    before = wide.clone()
    config = triton_lora.ExpandConfig(block_m=16, block_n=16, blocks_per_program=1)
    shrunk = reference.lora_shrink(batch["x"], batch["lora_a"], *grouping(batch))
    triton_lora.lora_expand_with(y, shrunk, batch["lora_b"], batch["slice_starts"], *grouping(batch), config)
    torch.testing.assert_close(y, run(reference, batch), atol=1e-5, rtol=1e-5)
    assert torch.equal(wide[:, :40], before[:, :40]) and torch.equal(wide[:, 72:], before[:, 72:])


def test_default_configs_split_k_only_while_the_token_tiles_leave_sms_idle():
    decode = triton_lora.shrink_config(1, 48, 2048, sm_count=132)
    batch = triton_lora.shrink_config(16384, 48, 2048, sm_count=132)
    assert decode.splits > 1 and batch.splits == 1
    assert triton_lora.shrink_config(1, 48, 2048).splits == 1  # the interpreter: no split


def test_expand_widens_its_programs_while_the_partials_they_reread_outweigh_y():
    many_partials = triton_lora.expand_config(256, (14336, 14336), rank=16, splits=8, sm_count=132)
    one_partial = triton_lora.expand_config(256, (14336, 14336), rank=16, splits=1, sm_count=132)
    assert many_partials.blocks_per_program > 1 and one_partial.blocks_per_program == 1
    # One token: the column programs alone must cover the SMs.
    assert triton_lora.expand_config(1, (4096,), rank=16, splits=32, sm_count=132).blocks_per_program == 1
