"""The one-shot all-reduce (``hookllm.distributed.custom_all_reduce``) on the CPU: two gloo ranks in spawned
processes share their buffers through shared memory, and the Triton kernel (interpreted) and
its torch reference give what gloo's all_reduce gives, fused with the residual and RMSNorm too,
call after call on the same buffers."""

import pytest
import torch

import tp_helpers
from hookllm import distributed, testing
from hookllm.distributed.custom_all_reduce import DEFAULT_MAX_BYTES, CustomAllReduce

WORLD = 2
PROMPTS = testing.random_prompts(2, 320, min_len=5, max_len=20, seed=3)


def run(tmp_path, monkeypatch, interpret: bool) -> list[dict]:
    if interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    tp_helpers.run_ranks(tp_helpers.custom_all_reduce_worker, WORLD, (WORLD, f"file://{tmp_path}/init", str(tmp_path)),
                         timeout_s=300)
    return [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]


@pytest.fixture(scope="module", params=[True, False], ids=["triton-interpreted", "torch-reference"])
def ranks(request, tmp_path_factory):
    with pytest.MonkeyPatch.context() as monkeypatch:
        return run(tmp_path_factory.mktemp("allreduce"), monkeypatch, request.param)


def test_every_call_equals_gloos_all_reduce_on_every_rank(ranks):
    for rank in ranks:
        for call, (got, expected) in enumerate(rank["results"]):
            if tp_helpers.ALL_REDUCE_CALLS[call][3]:
                continue
            # Two ranks' sum rounded once: the same bits as gloo's.
            assert torch.equal(got, expected), f"call {call}"


def test_the_fused_call_equals_all_reduce_then_the_residual_and_rms_norm(ranks):
    for rank in ranks:
        for call, (got, expected) in enumerate(rank["results"]):
            if not tp_helpers.ALL_REDUCE_CALLS[call][3]:
                continue
            (normed, hidden), (normed_ref, hidden_ref) = got, expected
            assert torch.equal(hidden, hidden_ref), f"call {call}"
            # The norm's float32 sum runs in another order than torch's: within a rounding.
            torch.testing.assert_close(normed, normed_ref, rtol=1e-2 if normed.dtype == torch.bfloat16 else 1e-5,
                                       atol=1e-5)


def test_every_rank_gets_the_same_bits(ranks):
    first, second = ranks
    for (a, _), (b, _) in zip(first["results"], second["results"]):
        for x, y in zip(a if isinstance(a, tuple) else [a], b if isinstance(b, tuple) else [b]):
            assert torch.equal(x, y)


def test_the_barrier_epochs_advance_two_per_call_in_step_on_both_ranks(ranks):
    first, second = ranks
    assert torch.equal(first["epochs"], second["epochs"])
    assert int(first["epochs"].max()) == 2 * len(tp_helpers.ALL_REDUCE_CALLS)


def test_only_small_contiguous_tensors_of_this_device_are_taken():
    custom = CustomAllReduce.__new__(CustomAllReduce)  # no peers needed to decide
    custom.max_bytes, custom.device = DEFAULT_MAX_BYTES, torch.device("cpu")
    assert custom.can_reduce(torch.zeros(64, 2048, dtype=torch.bfloat16))  # 256 KiB
    assert not custom.can_reduce(torch.zeros(256, 2048, dtype=torch.bfloat16))  # 1 MiB: NCCL's
    assert not custom.can_reduce(torch.zeros(8, 16).t())
    assert not custom.can_reduce(torch.zeros(8, 16, dtype=torch.int64))


def test_one_rank_never_builds_a_custom_all_reduce():
    assert distributed.init_custom_all_reduce(torch.device("cpu")) is False


@pytest.fixture(scope="module")
def model_ranks(tmp_path_factory):
    """The bias-carrying Llama case on two ranks with the one-shot all-reduce: (TP=1 logits, ranks)."""
    root = tmp_path_factory.mktemp("allreduce-model")
    path = testing.build_tiny_checkpoint(tp_helpers.CASES["llama-gqa-bias"](), root / "model")
    tp_helpers.randomize_biases(path)
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        tp_helpers.run_ranks(tp_helpers.custom_all_reduce_model_worker, WORLD,
                             (WORLD, f"file://{root}/init", str(path), PROMPTS, str(root)))
    tp1 = tp_helpers.paged_logits(tp_helpers.build_model(path), PROMPTS)
    return tp1, [torch.load(root / f"rank{rank}.pt") for rank in range(WORLD)]


def test_a_model_leaves_its_row_parallel_sums_to_the_norms_after_them(model_ranks):
    _, ranks = model_ranks
    for rank in ranks:
        assert not any(rank["o_proj_reduces"])
        # Layer 0's input norm reads the embedding (reduced already); every later norm reduces.
        assert rank["norms_reduce"][0] == (False, True)
        assert all(pair == (True, True) for pair in rank["norms_reduce"][1:-1]) and rank["norms_reduce"][-1] is True


def test_a_model_with_the_one_shot_all_reduce_gives_tp1s_logits_on_every_rank(model_ranks):
    tp1, ranks = model_ranks
    for rank in ranks:
        assert (rank["logits"] - tp1).abs().max() < testing.LOGITS_ATOL
    assert torch.equal(ranks[0]["logits"], ranks[1]["logits"])
