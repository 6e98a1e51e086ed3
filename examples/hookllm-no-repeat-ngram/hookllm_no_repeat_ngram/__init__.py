"""hookllm plugin: no n-gram occurs twice in a request's prompt and output (``no_repeat_ngram_size``).

    SamplingParams(extra_args={"no_repeat_ngram_size": 3})
    hookllm generate --plugin no-repeat-ngram --no-repeat-ngram-size 3 "..."

Under ``hookllm serve --plugin no-repeat-ngram`` the size goes in the request body's ``extra_args``,
and ``GET /v1/no-repeat-ngram/banned?text=...&size=N`` gives the token ids banned after ``text``.
"""

import torch

from hookllm import hookimpl

PAD = -1  # never a token id


def banned_tokens(histories: list[list[int]], sizes: list[int], vocab_size: int) -> torch.Tensor:
    """``[rows, vocab_size]`` bool: True where a token would end an n-gram (n = the row's size, 0 for
    none) already in the row's history, i.e. follow an earlier occurrence of its last n-1 tokens."""
    k = max(1, *sizes) - 1  # every row is compared on the longest suffix; masks keep each row's own
    tokens = torch.nn.utils.rnn.pad_sequence([torch.tensor(h, dtype=torch.long) for h in histories], batch_first=True,
                                             padding_value=PAD, padding_side="left")
    # Window i: the k tokens before history token i, then token i (k pads in front give each token one).
    windows = torch.nn.functional.pad(tokens, (k, 0), value=PAD).unfold(1, k + 1, 1)
    n = torch.tensor(sizes)
    lengths = torch.tensor([len(h) for h in histories])
    needed = torch.arange(k) >= k - (n[:, None] - 1)  # [rows, k]: the last n-1 of the k columns
    same = windows[..., :k] == tokens[:, tokens.shape[1] - k:][:, None, :]
    match = (same | ~needed[:, None, :]).all(-1) & (windows[..., k] != PAD) & ((n > 0) & (lengths >= n))[:, None]
    rows, at = match.nonzero(as_tuple=True)
    banned = torch.zeros(len(histories), vocab_size, dtype=torch.bool)
    banned[rows, windows[rows, at, k]] = True
    return banned


@hookimpl
def add_cli_options(parser):
    # Its dest is the extra_args key: a request setting it while the plugin is not active is
    # refused, not silently ignored.
    parser.add_argument("--no-repeat-ngram-size", type=int, dest="no_repeat_ngram_size", metavar="N",
                        help="no-repeat-ngram plugin: never generate an n-gram of N tokens twice")


@hookimpl
def process_logits(logits, batch):
    sizes = [r.sampling_params.extra_args.get("no_repeat_ngram_size") or 0 for r in batch.sampling_requests]
    if any(sizes):
        histories = [r.prompt_token_ids + output for r, output in
                     zip(batch.sampling_requests, batch.exact_output_token_ids())]
        logits.masked_fill_(banned_tokens(histories, sizes, logits.shape[1]).to(logits.device), float("-inf"))


@hookimpl
def add_routes(app, engine):
    @app.get("/v1/no-repeat-ngram/banned")
    async def banned(text: str, size: int) -> dict:
        """The token ids a request whose prompt is ``text`` (without special tokens) may not generate next."""
        history = await engine.tokenize(text, add_special_tokens=False)
        ids = banned_tokens([history], [size], max(history, default=0) + 1)[0].nonzero().flatten()
        return {"text": text, "size": size, "token_ids": ids.tolist()}
