"""hookllm plugin: OpenAI-style ``logit_bias`` and a ban list, per request.

    SamplingParams(extra_args={"logit_bias": {token_id: bias}, "banned_token_ids": [token_id, ...]})
    hookllm generate --plugin logit-bias --ban 42 --ban 7 "..."

Under ``hookllm serve --plugin logit-bias`` the fields go in the request body's ``extra_args``,
and ``GET /v1/logit-bias/token-ids?text=...`` gives the token ids to bias or ban.
"""

from hookllm import hookimpl
from hookllm.plugins.context import RequestParameters


@hookimpl
def claim_request_parameters():
    # So a request using them while the plugin is not active is refused, not silently ignored
    # ("banned_token_ids" is claimed as its flag's dest).
    return RequestParameters(extra_args=("logit_bias",))


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


@hookimpl
def add_routes(app, engine):
    @app.get("/v1/logit-bias/token-ids")
    async def token_ids(text: str) -> dict:
        """The ids ``text`` tokenizes to (without special tokens): the keys for ``logit_bias``."""
        return {"text": text, "token_ids": await engine.tokenize(text, add_special_tokens=False)}
