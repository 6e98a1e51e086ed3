"""hookllm plugin: OpenAI-style ``logit_bias`` and a ban list, per request.

    SamplingParams(extra_args={"logit_bias": {token_id: bias}, "banned_token_ids": [token_id, ...]})
"""

from hookllm import hookimpl


@hookimpl
def process_logits(logits, batch):
    for row, request in enumerate(batch.sampling_requests):
        extra = request.sampling_params.extra_args
        for token_id, bias in extra.get("logit_bias", {}).items():
            logits[row, int(token_id)] += bias
        banned = extra.get("banned_token_ids")
        if banned:
            logits[row, list(banned)] = float("-inf")
