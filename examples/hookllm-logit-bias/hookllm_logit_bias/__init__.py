"""hookllm plugin: OpenAI-style ``logit_bias`` and a ban list, per request.

    SamplingParams(extra_args={"logit_bias": {token_id: bias}, "banned_token_ids": [token_id, ...]})
    hookllm generate --plugin logit-bias --ban 42 --ban 7 "..."
"""

from hookllm import hookimpl


@hookimpl
def add_cli_options(parser):
    parser.add_argument("--ban", type=int, action="append", dest="banned_token_ids", metavar="TOKEN_ID",
                        help="logit-bias plugin: never sample this token id (repeatable)")


@hookimpl
def process_logits(logits, batch):
    for row, request in enumerate(batch.sampling_requests):
        extra = request.sampling_params.extra_args
        for token_id, bias in extra.get("logit_bias", {}).items():
            logits[row, int(token_id)] += bias
        banned = extra.get("banned_token_ids")
        if banned:
            logits[row, list(banned)] = float("-inf")
