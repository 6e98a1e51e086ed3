"""The one-shot all-reduce on CUDA: two ranks (two GPUs, or two processes on one) exchange
buffers through CUDA IPC; eager calls and CUDA-graph replays give every rank the float32 sum of
every rank's bf16 input in rank order, rounded once, and the fused call the reference
residual add and RMSNorm."""

import pytest
import torch

import tp_helpers
from hookllm.kernels import reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("custom-all-reduce")
    tp_helpers.run_ranks(tp_helpers.custom_all_reduce_gpu_worker, WORLD, (WORLD, f"file://{root}/init", str(root)))
    return [torch.load(root / f"rank{rank}.pt") for rank in range(WORLD)]


def test_eager_calls_and_graph_replays_sum_every_ranks_input(ranks):
    for rank in ranks:
        assert len(rank["records"]) == 4  # one eager pass, three replays
        for sent, _, got, _ in rank["records"]:
            # The first tensor is then normed in place (the fused call): checked below.
            for stacked, result in list(zip(sent, got))[1:]:
                assert torch.equal(result, stacked.float().sum(0).to(torch.bfloat16))


def test_the_fused_call_adds_the_residual_and_norms_as_the_reference(ranks):
    for rank in ranks:
        weight = rank["weight"]
        for sent, residual_before, got, residual_after in rank["records"]:
            reduced = sent[0].float().sum(0).to(torch.bfloat16)
            normed, hidden = reference.rms_norm(reduced, weight, 1e-5, residual_before)
            assert torch.equal(residual_after, hidden)
            torch.testing.assert_close(got[0], normed, rtol=1.6e-2, atol=1e-2)  # one bf16 ulp


def test_every_rank_holds_the_same_result(ranks):
    for a, b in zip(ranks[0]["records"], ranks[1]["records"]):
        assert all(torch.equal(x, y) for x, y in zip(a[2], b[2]))
