"""Pure-torch references for every Triton kernel.

These are the CPU backend of the paged ``Attention`` layer, the model layers and the sampler,
and the ground truth the Triton kernels in ``hookllm.kernels.triton_attention``,
``hookllm.kernels.triton_ops`` and ``hookllm.kernels.triton_moe`` are tested against; each
function here has the same signature as its Triton twin.

Cache layout (one tensor per layer and per K/V): ``[num_blocks, block_size, num_kv_heads,
head_dim]``. Token ``t`` of a sequence lives in block ``block_table[t // block_size]`` at
offset ``t % block_size``; its flat slot is ``block_id * block_size + offset``.
"""

from __future__ import annotations

import functools
from typing import TypeVar

import numpy as np
import torch
import torch.nn.functional as F


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int, -1 = do not store (padding)
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write each new token's K and V into its slot of the paged cache, in place.

    An FP8 cache stores ``to_fp8(key, k_scale)`` and ``to_fp8(value, v_scale)`` (the attention
    multiplies them back); any other cache dtype stores the values rounded to it, unscaled."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    slots = slot_mapping.long()
    if not bool((slots >= 0).all()):  # padded rows: boolean indexing only then (it costs more than the write)
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    for new, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        if cache.dtype == FP8_DTYPE:  # indexed writes have no float8 kernels: write the bytes
            cache, rows = cache.view(torch.uint8), to_fp8(new, scale).view(torch.uint8)
        else:
            rows = new.to(cache.dtype)
        cache.view(num_blocks * block_size, num_kv_heads, -1).index_copy_(0, slots, rows)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32: context length including this step's tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32: cumulative query lengths
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads], fp32 or the model dtype
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    causal: bool = True,
) -> torch.Tensor:
    """Causal attention of a mixed batch (prefill chunks and decodes) over the paged cache.

    Sequence ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``; these are its
    last ``q_len`` tokens, so query row ``j`` sits at position ``p = seq_len - q_len + j`` and
    sees cache positions ``0..p``. The new tokens' K/V must already be stored. Query heads are
    grouped onto KV heads (GQA): head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
    Scores are ``scale * q.k`` (models with ``query_pre_attn_scalar`` pass their own scale);
    softmax runs in fp32; the output has the query's dtype. The variants real models use:

    * ``sliding_window = W``: position ``p`` sees only keys ``p - W < k <= p`` (``W`` tokens,
      itself included: transformers' ``sliding_window``). Keys before the window of a
      sequence's first query row are never read, so their blocks may have been freed and
      their block-table entries may be -1 or point at any block, holding anything (NaN included).
    * ``softcap = c`` (Gemma 2): scores become ``c * tanh(s / c)``, ``s`` the scaled scores,
      before masking and softmax.
    * ``sinks`` (gpt-oss): one logit per query head, ``[num_heads]``, that joins the softmax's
      denominator only: ``probs_k = exp(s_k - m) / (sum_j exp(s_j - m) + exp(sink - m))``,
      ``m`` the maximum over the visible scores and the sink.
    * An FP8 cache (``store_kv``): keys are ``k_scale * k_cache``, values ``v_scale * v_cache``.
    * ``causal=False`` (encoders): bidirectional, every query row sees all ``seq_len`` keys of its
      sequence; with a window ``W``, the keys ``k`` with ``|k - p| < W`` (ModernBERT's local
      attention, ``W - 1`` on each side).
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    # One sequence owning every row (a CPU's batch 1): its rows are the output, no copy into one.
    alone = len(lens) == 1 and starts == [0, num_tokens] and num_tokens > 0
    out = None if alone else torch.empty_like(query)
    for i, seq_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        first_key = 0 if sliding_window is None else max(0, seq_len - q_len - sliding_window + 1)
        k, v = _gather_keys(k_cache, v_cache, block_tables[i], first_key, seq_len)
        q = query[q_start:q_end].float().transpose(0, 1)  # [H, q_len, D]
        k = (k.float() * k_scale if k_scale != 1.0 else k.float()).transpose(0, 1)  # [KV heads, keys, D]
        v = (v.float() * v_scale if v_scale != 1.0 else v.float()).transpose(0, 1)
        # A decode row sees every gathered key (the window's first key included): no mask.
        hidden = None
        if q_len > 1 and (causal or sliding_window is not None):
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            k_pos = torch.arange(first_key, seq_len, device=query.device)
            distance = q_pos[:, None] - k_pos[None, :]  # > 0: the key lies before the query
            hidden = distance < 0 if causal else distance <= -sliding_window
            if sliding_window is not None:
                hidden |= distance >= sliding_window
        if softcap is None and sinks is None:
            # torch's fused attention (GQA without repeating the keys): the CPU's attention path.
            attended = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True,
                                                      attn_mask=None if hidden is None else ~hidden)
        else:
            k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)  # [H, keys, D]
            scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [H, q_len, keys]
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            if hidden is not None:
                scores.masked_fill_(hidden, float("-inf"))
            attended = torch.matmul(_softmax_with_sinks(scores, sinks), v)
        rows = attended.transpose(0, 1).to(query.dtype)
        if alone:
            return rows.contiguous()
        out[q_start:q_end] = rows
    return out


def _gather_keys(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, first: int,
                 end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[end - first, num_kv_heads, head_dim]`` of one sequence's positions ``first..end-1``;
    the blocks before ``first``'s are not read."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    first_block = first // block_size
    blocks = block_table[first_block : -(-end // block_size)].long()
    offset = first_block * block_size
    k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[first - offset : end - offset]
    v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[first - offset : end - offset]
    return k, v


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of ``scores`` ``[heads, q_len, keys]``, each head's sink logit
    (if any) joining the denominator as one more key whose value is never read."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.to(scores.dtype)[:, None, None].expand(-1, scores.shape[1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


# The sampler's noise: a counter-based hash (murmur3's 32-bit finalizer) of a row's key and the
# vocabulary index, which ``sample_with_hashed_noise`` computes in registers on CUDA.
MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9  # scrambled into each word, so a zero word does not hash to zero

# Python ints, int64 numpy arrays and int64 tensors: the hash runs on each with the same code.
Words = TypeVar("Words", int, np.ndarray, torch.Tensor)


def _mul32(x: Words, c: int) -> Words:
    """``x * c`` mod 2^32 for ``x`` in [0, 2^32), in place on arrays. ``c`` is split into 16-bit
    halves so that no product leaves int64 (a wrapped product is undefined behaviour in C++)."""
    high = x * (c >> 16)
    high &= 0xFFFF
    high <<= 16
    x *= c & 0xFFFF
    x += high
    x &= MASK32
    return x


def _fmix32(h: Words) -> Words:
    """murmur3's 32-bit finalizer of ``h`` in [0, 2^32), in place on arrays."""
    h ^= h >> 16
    h = _mul32(h, 0x85EBCA6B)
    h ^= h >> 13
    h = _mul32(h, 0xC2B2AE35)
    h ^= h >> 16
    return h


def _scramble(word: Words) -> Words:
    return _fmix32(word ^ GOLDEN)


def absorb(h: Words, word: Words) -> Words:
    """The hash state ``h`` with one more 32-bit word mixed in. The word is scrambled before the
    xor, so two states differing in a few bits do not give the same stream shifted."""
    return _fmix32(h ^ _scramble(word))


@functools.lru_cache(maxsize=8)
def _scrambled_vocab(vocab: int, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False):  # a plain tensor: the cache outlives the inference_mode that built it
        return _scramble(torch.arange(vocab, dtype=torch.int64, device=device))


def hashed_exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise ``[len(keys), vocab]`` (float32) for 32-bit ``keys`` (int64).

    Element ``j`` of a row is ``-log(u)`` with ``u = (b + 0.5) / 2**23``, ``b`` the top 23 bits
    of the row's hash with ``j`` absorbed: ``u`` is in (0, 1) and exact in float32, so the noise
    is finite and positive, and the integers are exact on every device (the log's last bit may
    differ between libraries).
    """
    bits = _fmix32(keys[:, None] ^ _scrambled_vocab(vocab, keys.device)[None, :])
    bits >>= 9
    uniform = bits.float()
    del bits  # frees a [rows, vocab] int64 tensor before the float32 result is allocated
    uniform += 0.5
    uniform *= 2.0 ** -23
    return uniform.log_().neg_()


def hashed_uniform(keys: torch.Tensor, index: int) -> torch.Tensor:
    """Uniform (0, 1) float32, one per key: element ``index`` of each key's hash stream, as
    :func:`hashed_exponential_noise` draws its elements (an index past the vocabulary gives a
    number independent of the row's noise)."""
    bits = _fmix32(keys ^ _scramble(torch.full_like(keys, index)))
    bits >>= 9
    return (bits.float() + 0.5) * 2.0 ** -23


def rejection_sample(
    logits: torch.Tensor,  # [drafts + requests, vocab]: each request's draft rows, then its bonus row
    temperature: torch.Tensor,  # [rows] float32; 0 = greedy
    keys: torch.Tensor,  # [rows] int64 in [0, 2**32): each row's noise key
    threshold: torch.Tensor | None,  # [rows] float32: sampled rows draw only logits >= it (top-k/p, min-p)
    draft_ids: torch.Tensor,  # [drafts] long: the proposed tokens, request after request
    num_drafts: torch.Tensor,  # [requests] long: how many each request proposed (0 and up)
    max_drafts: int,  # host: the largest of num_drafts (the output's width less one)
    draft_probs: torch.Tensor | None = None,  # [drafts, vocab] float32: the proposer's q; None: it chose the token
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative decoding's verification (Leviathan et al.): each request's draft tokens are
    accepted in order while ``u < p(x) / q(x)`` (``p`` the target's distribution at that row,
    ``softmax(logits / T)`` within the threshold, ``u`` uniform); the first rejected position
    emits a token drawn from ``max(0, p - q)`` renormalized, and a request whose drafts were all
    accepted emits one more from its bonus row's ``p``. Every emitted token is then distributed
    as the target alone would draw it. A proposer that chose its token (n-gram lookup, a greedy
    draft) has ``q`` one-hot: the draft is accepted with probability ``p(x)``, a rejection draws
    from ``p`` without ``x``. Greedy rows accept the draft where it is the argmax, and emit the
    argmax.

    The randomness is the sampler's (:func:`sample_with_hashed_noise`): a row's draws use the
    exponential race over its ``keys`` noise, its ``u`` the element past the vocabulary of the
    same hash stream, so a seeded request's keys give the same tokens every time.

    Returns ``[requests, max_drafts + 1]`` token ids (the accepted drafts, then the drawn token;
    -1 after) and how many each request emits (accepted drafts + 1)."""
    rows, vocab = logits.shape
    requests = num_drafts.shape[0]
    device = logits.device
    x = logits.float()
    sampled = temperature > 0
    scores = x / torch.where(sampled, temperature, 1.0)[:, None]
    if threshold is not None:
        scores = scores.masked_fill(sampled[:, None] & (x < threshold[:, None]), float("-inf"))
    probs = scores.softmax(dim=-1)
    # Each row's request and position in it; the bonus row of request r is at position num_drafts[r].
    per_request = num_drafts + 1
    row_request = torch.repeat_interleave(torch.arange(requests, device=device), per_request)
    position = torch.arange(rows, device=device) - (per_request.cumsum(0) - per_request)[row_request]
    is_draft = position < num_drafts[row_request]
    draft_rows = is_draft.nonzero().squeeze(1)
    p_draft = probs[draft_rows].gather(1, draft_ids[:, None]).squeeze(1)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
        residual = probs[draft_rows].scatter(1, draft_ids[:, None], 0.0)
    else:
        q_draft = draft_probs.gather(1, draft_ids[:, None]).squeeze(1)
        residual = (probs[draft_rows] - draft_probs).clamp_(min=0.0)
    greedy_draft = ~sampled[draft_rows]
    u = hashed_uniform(keys[draft_rows], vocab)
    accepted = torch.where(greedy_draft, x[draft_rows].argmax(dim=-1) == draft_ids, u * q_draft < p_draft)
    accept_matrix = torch.zeros(requests, max_drafts, dtype=torch.int64, device=device)
    accept_matrix[row_request[draft_rows], position[draft_rows]] = accepted.long()
    num_accepted = accept_matrix.cumprod(dim=1).sum(dim=1)
    # What each row would emit as the request's drawn token: a draft row's recovery from its
    # residual, the bonus row's sample from p; greedy rows the argmax.
    noise = hashed_exponential_noise(keys, vocab)
    weights = probs.clone()
    weights[draft_rows] = residual
    drawn = torch.where(sampled, (weights / noise).argmax(dim=-1), x.argmax(dim=-1))
    drawn_matrix = torch.full((requests, max_drafts + 1), -1, dtype=torch.long, device=device)
    drawn_matrix[row_request, position] = drawn
    draft_matrix = torch.full((requests, max_drafts + 1), -1, dtype=torch.long, device=device)
    draft_matrix[row_request[draft_rows], position[draft_rows]] = draft_ids
    column = torch.arange(max_drafts + 1, device=device)[None, :]
    tokens = torch.where(column < num_accepted[:, None], draft_matrix, -1)
    tokens = torch.where(column == num_accepted[:, None], drawn_matrix, tokens)
    return tokens, num_accepted + 1


def sample_with_hashed_noise(
    logits: torch.Tensor,  # [rows, vocab], any float dtype
    temperature: torch.Tensor,  # [rows] float32; 0 = greedy
    keys: torch.Tensor,  # [rows] int64 in [0, 2**32): each row's noise key (not read for greedy rows)
    threshold: torch.Tensor | None = None,  # [rows] float32: sampled rows draw only logits >= it
) -> torch.Tensor:
    """One token id per row: ``argmax(softmax(logits / T) / q)``, or ``argmax(logits)`` where T = 0,
    with ``q = hashed_exponential_noise(keys, vocab)``; with ``threshold``, a sampled row's
    logits below its threshold are left out (top-k / top-p / min-p, already decided).

    With ``q ~ Exp(1)`` this draws from ``softmax(logits / T)`` (the exponential race); it is
    computed as ``argmax(logits / T - log(q))``, the same order without the softmax.
    """
    x = logits.float()
    sampled = temperature > 0
    scores = x / torch.where(sampled, temperature, 1.0)[:, None] - hashed_exponential_noise(keys, x.shape[1]).log()
    if threshold is not None:
        scores = scores.masked_fill(x < threshold[:, None], float("-inf"))
    return torch.where(sampled[:, None], scores, x).argmax(dim=-1)


def filter_thresholds(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
    needed: int, any_top_p: bool,
) -> torch.Tensor:
    """Each row's smallest logit that its top-k, top-p and min-p filters keep (float32 ``[rows]``;
    -inf keeps all): the filters act on ``softmax(logits / T)`` and keep exactly the tokens whose
    logit is at least the threshold, ties at the boundary included. They chain as transformers'
    do (top-k, then top-p over the renormalized top k, then min-p, which is relative to the top
    probability and so unchanged by the renormalization). The top token always stays.

    ``top_k`` <= 0, ``top_p`` = 1 and ``min_p`` = 0 disable each (greedy rows get -inf).
    ``any_top_p`` and ``needed`` are host values (no device sync): whether any row has a top-p,
    and how many of each row's largest logits the filters can need. That is the largest
    ``top_k`` when every row with a top-p also has a top-k (its nucleus then lies within them:
    no sort of the vocabulary), the vocabulary when some row's top-p stands
    alone, and 0 when only min-p is asked for, which needs no ranking: ``p >= min_p * p_max``
    is ``logit >= max + T * log(min_p)``. (The Triton twin reads only whether ``needed`` is 0:
    it ranks without ``topk``.)"""
    rows, vocab = logits.shape
    top_k = top_k.long()  # the sampler's table holds it as a float
    scale = torch.where(temperature > 0, temperature, 1.0)
    none = torch.full((rows,), float("-inf"), device=logits.device)
    if needed:
        values = logits.topk(min(needed, vocab), dim=-1).values.float()  # largest first
        top = values[:, 0]
        k = torch.where(top_k > 0, top_k.clamp(max=values.shape[1]), values.shape[1])
        threshold = torch.where(top_k > 0, values.gather(1, (k - 1)[:, None]).squeeze(1), none)
        if any_top_p:
            # The nucleus of what the top-k keeps (renormalized over it, as transformers' and vLLM's
            # filters chain): its largest logits while the mass before each is below top_p. A row
            # without a top-k has the whole vocabulary in ``values``.
            scaled = torch.where(values >= threshold[:, None], values / scale[:, None], float("-inf"))
            log_total = torch.logsumexp(scaled, dim=-1)
            probs = torch.exp(values / scale[:, None] - log_total[:, None])
            kept = ((probs.cumsum(dim=-1) - probs) < top_p[:, None]).sum(dim=-1).clamp(min=1)
            nucleus = values.gather(1, (kept - 1)[:, None]).squeeze(1)
            threshold = torch.where(top_p < 1.0, torch.maximum(threshold, nucleus), threshold)
    else:
        top, threshold = logits.max(dim=-1).values.float(), none
    above_min_p = top + scale * torch.log(min_p)  # -inf where min_p = 0
    threshold = torch.where(min_p > 0.0, torch.maximum(threshold, above_min_p), threshold)
    return torch.where(temperature > 0, threshold, none)


def token_logprobs(
    logits: torch.Tensor,  # [rows, vocab], any float dtype
    token_ids: torch.Tensor,  # [rows] long: the token of each row whose logprob is asked
    num_top: int,  # how many of each row's most likely tokens to report (0: none)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's ``log_softmax`` at ``token_ids`` (float32), that token's rank (1 + how many
    logits are larger, long: counted on the logits, which subtracting the row's log-sum-exp in
    float32 could tie), and the row's ``num_top`` largest logprobs with their ids, largest first
    (``[rows, num_top]``; ties in any order)."""
    x = logits.float()
    logprobs = x.log_softmax(dim=-1)
    ranks = (x > x.gather(1, token_ids[:, None])).sum(dim=-1) + 1
    top_values, top_ids = logprobs.topk(num_top, dim=-1)
    return logprobs.gather(1, token_ids[:, None]).squeeze(1), ranks, top_values, top_ids


def apply_penalties(
    logits: torch.Tensor,  # [rows, vocab] float32, modified in place
    rows: torch.Tensor,  # [n] long: the logits rows to adjust
    slots: torch.Tensor,  # [n] long: each row's slot in the tables below
    bias: torch.Tensor,  # [slots, vocab] float32: added first (logit bias, -inf for banned tokens)
    counts: torch.Tensor,  # [slots, vocab] int32: how often each token was generated
    prompt_mask: torch.Tensor,  # [slots, vocab] bool: the tokens of the prompt
    penalties: torch.Tensor,  # [slots, 3] float32: presence, frequency, repetition
) -> None:
    """vLLM's order: the bias, then the repetition penalty on every token seen in the prompt or
    the output (positive logits divided by it, negative ones multiplied), then the frequency
    penalty times each token's count and the presence penalty once for each generated token."""
    x = logits[rows] + bias[slots]
    row_counts = counts[slots]
    presence, frequency, repetition = penalties[slots].unbind(dim=1)
    seen = prompt_mask[slots] | (row_counts > 0)
    repeated = torch.where(x > 0, x / repetition[:, None], x * repetition[:, None])
    x = torch.where(seen, repeated, x)
    x -= frequency[:, None] * row_counts + presence[:, None] * (row_counts > 0)
    logits[rows] = x


def apply_token_bitmask(
    logits: torch.Tensor,  # [rows, vocab], modified in place
    bitmask: torch.Tensor,  # [k, words] int32: bit j of word i allows token 32 * i + j
    rows: torch.Tensor,  # [k] long: the logits row each mask row applies to
) -> None:
    """Set to -inf every token of ``logits[rows[k]]`` whose bit is 0 in ``bitmask[k]``; tokens
    past the mask's width (``32 * words``) are masked too. Other rows are left as they are."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1).bool()
    vocab = logits.shape[1]
    if allowed.shape[1] < vocab:
        allowed = torch.cat([allowed, allowed.new_zeros(allowed.shape[0], vocab - allowed.shape[1])], dim=1)
    logits[rows] = logits[rows].masked_fill(~allowed[:, :vocab], float("-inf"))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x`` ``[rows, hidden]``; with ``residual``: ``(norm(x + residual), x + residual)``.

    As transformers computes it: the sum in the input dtype, the norm in fp32, cast back to the
    input dtype before the weight multiply.
    """
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    normed = x.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * normed.to(dtype)
    return out if residual is None else (out, x)


def one_shot_all_reduce(x: torch.Tensor, peers, residual: torch.Tensor | None = None,
                        weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """Sum ``x`` ``[rows, hidden]`` over the ranks through their mapped buffers, in place, in rank
    order (float32, then the dtype: the same bits on every rank). With ``residual``: returns
    ``(norm(sum + residual), sum + residual)`` as :func:`rms_norm` does, the first in ``x``
    itself, the second a new tensor. ``peers`` is a :class:`hookllm.distributed.custom_all_reduce.PeerMemory`; the ranks
    meet on its signal pads as the Triton kernel's program 0 does (a reference on the CPU: it
    spins in Python)."""
    rows, cols = x.shape
    rank = peers.rank
    views = [buffer[:x.numel() * x.element_size()].view(x.dtype).view(rows, cols) for buffer in peers.buffers]
    views[rank].copy_(x)
    epoch = int(peers.epochs[0]) + 1
    _meet(peers, epoch)
    total = torch.zeros(rows, cols, dtype=torch.float32, device=x.device)
    for view in views:
        total += view.float()
    x.copy_(total.to(x.dtype))
    _meet(peers, epoch + 1)
    peers.epochs[0] = epoch + 1
    if residual is None:
        return x
    normed, hidden = rms_norm(x, weight, eps, residual)
    x.copy_(normed)
    return x, hidden


def _meet(peers, epoch: int) -> None:
    """Program 0's signal: ``epoch`` into slot (0, rank) of every pad, then wait for every rank's."""
    world, rank = len(peers.buffers), peers.rank
    for pad in peers.signals:
        pad[rank] = epoch
    own = peers.signals[rank]
    while int(own[:world].min()) < epoch:
        pass


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor,
                 head_dim: int) -> None:
    """Rotate ``q`` ``[tokens, heads * head_dim]`` and ``k`` in place by their tokens' positions.

    NeoX / HF "rotate half" layout; ``cos_sin`` is ``[max_position, head_dim]`` fp32, the cos
    half then the sin half. Computed in fp32, rounded to the input dtype.
    """
    cos, sin = cos_sin.index_select(0, positions)[:, None, :].chunk(2, dim=-1)
    num_tokens, item = q.shape[0], q.element_size()
    if k.data_ptr() == q.data_ptr() + q.shape[1] * item and q.stride() == k.stride() and q.stride(1) == 1:
        # k's heads follow q's in each row (views of one fused projection): rotated as one tensor.
        heads = (q.shape[1] + k.shape[1]) // head_dim
        pairs = [q.as_strided((num_tokens, heads, head_dim), (q.stride(0), head_dim, 1))]
    else:
        pairs = [x.view(num_tokens, -1, head_dim) for x in (q, k)]
    for x in pairs:
        x1, x2 = x.float().chunk(2, dim=-1)
        x.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``[rows, 2 * d]`` laid out as (gate, up) -> ``silu(gate) * up``, ``[rows, d]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


# Mixture of experts. Expert weights are stacked as transformers stores them for Mixtral and
# Qwen3-MoE: ``w_gate_up`` ``[experts, 2 * inter, hidden]`` (each expert's gate rows, then its up
# rows) and ``w_down`` ``[experts, hidden, inter]``, so both are ``nn.Linear`` weights per expert.
# gpt-oss stores ``[in, out]`` matrices with gate and up columns interleaved: its adapter passes
# them de-interleaved and transposed (the Triton kernels take transposed views as they are).
MOE_ACTIVATIONS = ("silu", "swiglu_oai")
SWIGLU_OAI_ALPHA = 1.702  # gpt-oss's sigmoid sharpness: gate * sigmoid(1.702 * gate)


def route(router_logits: torch.Tensor, top_k: int, *, renormalize: bool,
          softmax_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts from its router logits ``[tokens, experts]``: weights
    ``[tokens, top_k]`` float32 and expert ids ``[tokens, top_k]`` int32, best first.

    ``softmax_first`` (Mixtral, Qwen3-MoE): softmax over all experts, then the top k
    probabilities, which ``renormalize`` (``norm_topk_prob``) rescales to sum to 1. Otherwise
    (gpt-oss): the top k logits, then a softmax over those k, which already sum to 1.
    Shared by the torch and Triton paths: one top-k launch, nothing for a kernel to fuse."""
    logits = router_logits.float()
    if softmax_first:
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        top_logits, ids = torch.topk(logits, top_k, dim=-1)
        weights = torch.softmax(top_logits, dim=-1)
    return weights, ids.to(torch.int32)


def moe_align(topk_ids: torch.Tensor, num_experts: int,
              block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs of ``topk_ids`` ``[tokens, top_k]`` grouped by expert, each expert's
    group padded to a multiple of ``block_m``, for a grouped GEMM over blocks of one expert.

    Pair ``p = token * top_k + slot`` (an index into ``topk_ids.flatten()``). Returns
    ``sorted_token_ids`` (int32): the pairs, expert 0's first, each expert's pairs in order of
    ``p`` followed by sentinels (``pairs = tokens * top_k``, out of range) up to the next
    multiple of ``block_m``, and sentinels past the last expert's run; ``expert_of_block`` (int32): block ``b``'s expert (rows
    ``b * block_m:(b + 1) * block_m``), ``num_experts`` for blocks past the end;
    ``num_padded`` (int32, one element): how many entries are used. Experts with no pair get no
    block. Both lists are sized for the worst case (every expert's group one short of a block's
    multiple), so every shape is known on the host: nothing waits for the device.

    An id equal to ``num_experts`` marks a pair whose expert is absent (held by another
    expert-parallel rank): it gets no row, and its output row is never written.
    """
    flat = topk_ids.flatten().long()
    pairs = flat.numel()
    # scatter_add rather than bincount, whose output size (and so a host sync) depends on the ids.
    # One extra bin counts the absent pairs, which sort last and are dropped.
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    # The absent bin gets no rows (concatenated rather than assigned: no host-to-device copy).
    padded_counts = torch.cat([(counts[:num_experts] + block_m - 1) // block_m * block_m, counts.new_zeros(1)])
    padded_ends = torch.cumsum(padded_counts, dim=0)
    padded_starts = padded_ends - padded_counts
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank_in_expert = torch.arange(pairs, device=flat.device) - (torch.cumsum(counts, dim=0) - counts)[expert]
    max_padded = pairs + num_experts * (block_m - 1)
    # Absent pairs write one slot past the end, cut off below.
    sorted_token_ids = torch.full((max_padded + 1,), pairs, dtype=torch.int32, device=flat.device)
    destination = torch.where(expert < num_experts, padded_starts[expert] + rank_in_expert, max_padded)
    sorted_token_ids[destination] = order.to(torch.int32)
    sorted_token_ids = sorted_token_ids[:max_padded]
    padded_ends = padded_ends[:num_experts]
    block_starts = torch.arange(0, max_padded, block_m, device=flat.device)
    expert_of_block = torch.searchsorted(padded_ends, block_starts, right=True).to(torch.int32)
    return sorted_token_ids, expert_of_block, padded_ends[-1:].to(torch.int32)


def moe_activation(gate: torch.Tensor, up: torch.Tensor, activation: str,
                   swiglu_limit: float | None) -> torch.Tensor:
    """The gated activation of an expert's gate and up projections.

    ``"silu"`` (Mixtral, Qwen3-MoE): ``silu(gate) * up``. ``"swiglu_oai"`` (gpt-oss): with
    ``gate`` clamped to at most ``swiglu_limit`` and ``up`` to ``[-limit, limit]`` (no clamp if
    None), ``gate * sigmoid(1.702 * gate) * (up + 1)``."""
    if activation == "silu":
        return torch.nn.functional.silu(gate) * up
    if swiglu_limit is not None:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(-swiglu_limit, swiglu_limit)
    return gate * torch.sigmoid(SWIGLU_OAI_ALPHA * gate) * (up + 1)


def check_moe_activation(activation: str, swiglu_limit: float | None) -> None:
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"activation must be one of {MOE_ACTIVATIONS}, got {activation!r}")
    if swiglu_limit is not None and activation != "swiglu_oai":
        raise ValueError("swiglu_limit applies to activation='swiglu_oai' only")


def fused_moe(
    hidden: torch.Tensor,  # [tokens, hidden]
    w_gate_up: torch.Tensor,  # [experts, 2 * inter, hidden]: gate rows, then up rows
    w_down: torch.Tensor,  # [experts, hidden, inter]
    topk_weights: torch.Tensor,  # [tokens, top_k] float32
    topk_ids: torch.Tensor,  # [tokens, top_k] int
    *,
    activation: str = "silu",
    gate_up_bias: torch.Tensor | None = None,  # [experts, 2 * inter]
    down_bias: torch.Tensor | None = None,  # [experts, hidden]
    swiglu_limit: float | None = None,
    experts_elsewhere: bool = False,  # ids may be ``experts`` (absent); the Triton twin then zeroes first
    gate_up_scale: torch.Tensor | None = None,  # [experts, 2 * inter, groups] float32: e4m3 weights
    down_scale: torch.Tensor | None = None,  # [experts, hidden, groups] float32
) -> torch.Tensor:
    """The experts' output ``[tokens, hidden]``: for each token, the sum over its ``top_k``
    experts ``e`` of ``weight * down_e(act(gate_e(x), up_e(x)))`` (see ``moe_activation``),
    biases added to each projection's output. Matmuls run in the input dtype, as transformers'
    expert loop does; the weighted sum is accumulated in the input dtype too. A pair whose id is
    ``experts`` (absent: see ``moe_align``) adds nothing.

    With scales the weights are e4m3 and each projection is the weight-only
    :func:`scaled_matmul` of its expert (scales per output row and group of input columns)."""
    check_moe_activation(activation, swiglu_limit)
    inter = w_down.shape[2]
    out = torch.zeros_like(hidden)
    for expert in range(w_gate_up.shape[0]):
        token, slot = torch.where(topk_ids == expert)
        if token.numel() == 0:
            continue
        gate_up = _expert_linear(hidden[token], w_gate_up, gate_up_scale, gate_up_bias, expert)
        act = moe_activation(gate_up[:, :inter], gate_up[:, inter:], activation, swiglu_limit)
        down = _expert_linear(act, w_down, down_scale, down_bias, expert)
        out.index_add_(0, token, (down * topk_weights[token, slot, None]).to(hidden.dtype))
    return out


def _expert_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
                   expert: int) -> torch.Tensor:
    bias = None if bias is None else bias[expert]
    if scale is None:
        return torch.nn.functional.linear(x, weight[expert], bias)
    return scaled_matmul(x, None, weight[expert], scale[expert], x.dtype, bias)


# FP8 (e4m3): weights and activations as 8-bit floats with float32 scales (hookllm.bundled.fp8).
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
# Smallest dynamic scale: an all-zero group quantizes to zeros instead of dividing by zero.
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` rounded to e4m3, saturating at +-448 (torch's cast alone overflows to NaN)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def expand_groups(scale: torch.Tensor, columns: int) -> torch.Tensor:
    """``[rows, G]`` group scales -> ``[rows, columns]``: group ``g`` covers columns
    ``g * ceil(columns / G)`` onwards (the last group may be short)."""
    group = -(-columns // scale.shape[1])
    return scale.float().repeat_interleave(group, dim=1)[:, :columns]


def quantize_fp8(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric quantization of each row of ``x`` ``[M, K]`` in groups of ``group_size``
    columns (``K``: one scale per row, per-token): ``scale = max(amax / 448, FP8_MIN_SCALE)``
    per group, ``q = to_fp8(x, scale)``. Returns ``(q [M, K] e4m3, scale [M, ceil(K / group_size)]
    float32)``."""
    rows, columns = x.shape
    groups = -(-columns // group_size)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group_size - columns))
    amax = padded.view(rows, groups, group_size).abs().amax(dim=2)
    scale = (amax / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    return to_fp8(x, expand_groups(scale, columns)), scale


def scaled_matmul(a: torch.Tensor, a_scale: torch.Tensor | None, b: torch.Tensor, b_scale: torch.Tensor,
                  out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``(a * a_scale) @ (b * b_scale)^T + bias`` in float32, rounded to ``out_dtype``.

    ``a`` ``[M, K]``: e4m3 with ``a_scale`` ``[M, Ga]`` (a stride-0 ``expand`` of one static
    scale is fine), or the model dtype with ``a_scale=None`` (weight-only). ``b`` ``[N, K]`` e4m3
    with ``b_scale`` ``[N, Gb]``. A scale's ``G`` columns each cover ``ceil(K / G)`` columns of
    its operand (see :func:`expand_groups`): ``G = 1`` is per-token / per-output-channel;
    block-quantized weights and per-group activations share one group size."""
    columns = a.shape[1]
    a_full = a.float() if a_scale is None else a.float() * expand_groups(a_scale, columns)
    out = a_full @ (b.float() * expand_groups(b_scale, columns)).T
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


# Multi-LoRA (hookllm.kernels.triton_lora): a batch's tokens use up to L adapter slots at once.
# ``token_order`` lists the token indices grouped by slot: slot l's tokens are
# ``token_order[slot_starts[l] : slot_starts[l] + slot_counts[l]]``; tokens in no slot's range
# (base-model rows, CUDA-graph padding) are never read or written.


def _slot_tokens(token_order: torch.Tensor, slot_starts: torch.Tensor,
                 slot_counts: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(slot, its token indices) of each slot with tokens."""
    return [(slot, token_order[start:start + count].long())
            for slot, (start, count) in enumerate(zip(slot_starts.tolist(), slot_counts.tolist())) if count]


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_order: torch.Tensor, slot_starts: torch.Tensor,
                slot_counts: torch.Tensor) -> torch.Tensor:
    """``x[t] @ lora_a[l].T`` in float32 for each token ``t`` of slot ``l``, as ``[P, T, N]`` partial
    sums to be summed over dim 0 (here P = 1; rows of tokens in no slot hold anything).

    ``x`` ``[T, K]``; ``lora_a`` ``[L, N, K]`` in ``x``'s dtype, ``N = slices * R``: each slice's A
    (rank R, zero-padded) stacked on dim 1."""
    out = torch.zeros((1, x.shape[0], lora_a.shape[1]), dtype=torch.float32, device=x.device)
    for slot, tokens in _slot_tokens(token_order, slot_starts, slot_counts):
        out[0, tokens] = x[tokens].float() @ lora_a[slot].float().T
    return out


def lora_expand(y: torch.Tensor, shrunk: torch.Tensor, lora_b: torch.Tensor, slice_starts: tuple[int, ...],
                token_order: torch.Tensor, slot_starts: torch.Tensor, slot_counts: torch.Tensor) -> None:
    """Add each slot's delta into ``y`` ``[T, OUT]`` in place: for each token ``t`` of slot ``l`` and
    slice ``i``, ``y[t, cols_i] += shrunk[:, t, i*R:(i+1)*R].sum(0) @ lora_b[l, cols_i].T``, in float32,
    rounded to ``y``'s dtype once; other rows untouched.

    ``shrunk``: ``lora_shrink``'s partials ``[P, T, N]``; ``lora_b`` ``[L, OUT, R]`` in ``y``'s dtype
    (the adapter's scaling folded in); ``slice_starts`` ``(0, s1, ..., OUT)``: output columns
    ``cols_i = [slice_starts[i], slice_starts[i+1])`` read shrunk columns ``[i*R, (i+1)*R)``."""
    rank = lora_b.shape[2]
    hidden = shrunk.sum(dim=0)
    slices = list(zip(slice_starts, slice_starts[1:]))
    for slot, tokens in _slot_tokens(token_order, slot_starts, slot_counts):
        delta = torch.cat([hidden[tokens, i * rank:(i + 1) * rank] @ lora_b[slot, start:end].float().T
                           for i, (start, end) in enumerate(slices)], dim=1)
        y[tokens] = (y[tokens].float() + delta).to(y.dtype)
