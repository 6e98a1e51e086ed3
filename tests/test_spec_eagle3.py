"""The ``eagle3`` proposer: an EAGLE-3 head in its published checkpoint format (``midlayer.*``,
``fc``, ``d2t``) guesses from the target's residual streams. Its guesses at every proposing step
equal a plain-torch EAGLE-3 forward (written here from the method's definition) over
transformers' hidden states of the same target; and, as with any proposer, a request's tokens
are those without speculation."""

from __future__ import annotations

import json
import types

import pytest
import torch
from safetensors.torch import save_file

from hookllm import EngineConfig, hookimpl, testing
from hookllm.engine.llm_engine import LLMEngine
from hookllm.plugins.manager import PluginInfo, PluginManager, discover_plugins
from hookllm.spec.eagle import Eagle3Proposer
from test_spec_decode import MAX_TOKENS, PROMPTS, generate, greedy_run, make_engine, spec_counts

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB, DRAFT_VOCAB = 64, 4, 2, 16, 128, 320, 100
AUX_LAYERS = [0, 2, 3]  # of a 4-layer target
EPS = 1e-6


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("eagle-target")
    testing.build_tiny_checkpoint(testing.tiny_llama_config(num_hidden_layers=4, rms_norm_eps=EPS), path)
    return path


def build_eagle3_head(target_dir, path, draft_vocab: int = DRAFT_VOCAB, aux_layers=AUX_LAYERS, seed: int = 5):
    """A random EAGLE-3 head for the checkpoint ``target_dir``, saved into ``path`` as the
    published heads are; its config's positions (128) are fewer than the target's (a head takes
    the target's)."""
    target = json.loads((target_dir / "config.json").read_text())
    hidden, inter, heads = target["hidden_size"], target["intermediate_size"], target["num_attention_heads"]
    kv_heads, head_dim = target["num_key_value_heads"], target["hidden_size"] // target["num_attention_heads"]
    vocab = target["vocab_size"]
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator) * 0.2

    targets = torch.randperm(vocab, generator=generator)[:draft_vocab].sort().values
    tensors = {
        "midlayer.self_attn.q_proj.weight": randn(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": randn(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": randn(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": randn(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": randn(inter, hidden),
        "midlayer.mlp.up_proj.weight": randn(inter, hidden),
        "midlayer.mlp.down_proj.weight": randn(hidden, inter),
        "midlayer.input_layernorm.weight": 1 + randn(hidden),
        "midlayer.hidden_norm.weight": 1 + randn(hidden),
        "midlayer.post_attention_layernorm.weight": 1 + randn(hidden),
        "fc.weight": randn(hidden, 3 * hidden),
        "norm.weight": 1 + randn(hidden),
        "lm_head.weight": randn(draft_vocab, hidden) * 5,
        "d2t": targets - torch.arange(draft_vocab),
        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, targets, True),
    }
    path.mkdir(parents=True, exist_ok=True)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(path / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "num_hidden_layers": 1, "vocab_size": vocab, "draft_vocab_size": draft_vocab,
              "max_position_embeddings": 128, "rms_norm_eps": target["rms_norm_eps"], "tie_word_embeddings": False,
              "eagle_aux_hidden_state_layer_ids": list(aux_layers)}
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def head_dir(target_dir, tmp_path_factory):
    return build_eagle3_head(target_dir, tmp_path_factory.mktemp("eagle-head"))


class ReferenceEagle3:
    """EAGLE-3's forward in plain torch over whole sequences: the target's streams from
    transformers' ``output_hidden_states``, the head's weights read from its file."""

    def __init__(self, target_dir, head_dir):
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        self.w = load_file(str(head_dir / "model.safetensors"))

    @staticmethod
    def rms(x, weight):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)

    @staticmethod
    def rope(x, positions):
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
        angles = positions[:, None].float() * inv_freq[None]
        cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
        half = torch.cat([-x[..., HEAD_DIM // 2:], x[..., :HEAD_DIM // 2]], -1)
        return x * cos + half * sin

    def head(self, tokens, features):
        """Positions 0 .. n-1 reading ``tokens`` (each the token after its position) and
        ``features``: (logits over the draft vocabulary, outputs before the norm)."""
        w, n = self.w, len(tokens)
        embeds = self.target.model.embed_tokens(torch.tensor(tokens))
        x = torch.cat([self.rms(embeds, w["midlayer.input_layernorm.weight"]),
                       self.rms(features, w["midlayer.hidden_norm.weight"])], -1)
        positions = torch.arange(n)
        q = self.rope((x @ w["midlayer.self_attn.q_proj.weight"].T).view(n, HEADS, HEAD_DIM), positions)
        k = self.rope((x @ w["midlayer.self_attn.k_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM), positions)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM)
        k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * HEAD_DIM ** -0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, HIDDEN)
        hidden = attn @ w["midlayer.self_attn.o_proj.weight"].T + features
        normed = self.rms(hidden, w["midlayer.post_attention_layernorm.weight"])
        gate, up = normed @ w["midlayer.mlp.gate_proj.weight"].T, normed @ w["midlayer.mlp.up_proj.weight"].T
        hidden = (torch.nn.functional.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T + hidden
        return self.rms(hidden, w["norm.weight"]) @ w["lm_head.weight"].T, hidden

    @torch.inference_mode()
    def guesses(self, history: list[int], k: int) -> list[int]:
        """The head's k greedy guesses after ``history`` (prompt and output so far)."""
        out = self.target(torch.tensor([history[:-1]]), output_hidden_states=True)
        streams = torch.cat([out.hidden_states[layer][0] for layer in AUX_LAYERS], -1)
        tokens, features = history[1:], streams @ self.w["fc.weight"].T
        guesses = []
        for _ in range(k):
            logits, before_norm = self.head(tokens, features)
            draft_id = int(logits[-1].argmax())
            guesses.append(draft_id + int(self.w["d2t"][draft_id]))
            tokens, features = tokens + [guesses[-1]], torch.cat([features, before_norm[-1:]])
        return guesses


class RecordingEagle3(Eagle3Proposer):
    """``eagle3``, keeping each proposing step's histories and the head's guesses. With
    ``answers`` (prompt -> its greedy output) it proposes those instead, so that runs of
    guesses are accepted and the head's later passes start after them."""

    records: list[tuple[list[int], list[int]]] = []
    answers: dict[tuple[int, ...], list[int]] = {}

    def propose(self, batch):
        ids, counts = super().propose(batch)
        for i, request in enumerate(batch.requests):
            RecordingEagle3.records.append((batch.history(i), ids[i, :counts[i]].tolist()))
            answer = RecordingEagle3.answers.get(tuple(request.prompt_token_ids))
            if answer is not None:
                done = int(batch.num_tokens[i]) - request.num_prompt_tokens
                ids[i, :counts[i]] = (answer[done:done + counts[i]] + [0] * counts[i])[:counts[i]]
        return ids, counts


def recording_engine(target_dir, head_dir, k: int, **options) -> LLMEngine:
    module = types.ModuleType("recording_eagle3")
    module.register_spec_proposers = hookimpl(lambda proposers: proposers.add("recording_eagle3", RecordingEagle3))
    plugins = {**discover_plugins(), "recording_eagle3": PluginInfo("recording_eagle3", module)}
    options = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 64, **options}
    config = EngineConfig(str(target_dir), speculative_config={"method": "recording_eagle3", "model": str(head_dir),
                                                               "num_speculative_tokens": k}, **options)
    return LLMEngine(config, PluginManager(plugins))


@pytest.fixture(scope="module")
def expected_greedy(target_dir):
    return greedy_run(target_dir, None)[0]


@pytest.mark.parametrize("options", [{}, {"async_scheduling": True},
                                     {"max_num_batched_tokens": 9, "num_kv_blocks": 5}],
                         ids=["sync", "async", "chunked-and-preempted"])
def test_every_guess_is_the_eagle3_forward_over_the_targets_streams(target_dir, head_dir, expected_greedy,
                                                                   options):
    RecordingEagle3.records, RecordingEagle3.answers = [], {}
    engine = recording_engine(target_dir, head_dir, 3, **options)
    outputs, _ = generate(engine, PROMPTS, testing.greedy(MAX_TOKENS))
    assert outputs == expected_greedy
    reference = ReferenceEagle3(target_dir, head_dir)
    assert len(RecordingEagle3.records) >= len(PROMPTS) * 2
    for history, guesses in RecordingEagle3.records:
        assert guesses == reference.guesses(history, 3)[:len(guesses)], f"after {history}"


def test_the_heads_guesses_stay_right_after_accepted_runs(target_dir, head_dir, expected_greedy):
    """Its proposals replaced by the right answers, every guess is kept: the head's passes then
    start after runs of accepted tokens, and its guesses still equal the reference's."""
    RecordingEagle3.records = []
    RecordingEagle3.answers = {tuple(p): out for p, out in zip(PROMPTS, expected_greedy)}
    engine = recording_engine(target_dir, head_dir, 3)
    outputs, _ = generate(engine, PROMPTS, testing.greedy(MAX_TOKENS))
    RecordingEagle3.answers = {}
    assert outputs == expected_greedy
    drafted, accepted = spec_counts(engine)
    assert accepted == drafted > 0
    reference = ReferenceEagle3(target_dir, head_dir)
    for history, guesses in RecordingEagle3.records:
        assert guesses == reference.guesses(history, 3)[:len(guesses)], f"after {history}"


def test_prefix_cache_hits_carry_the_heads_cache(target_dir, head_dir, expected_greedy):
    """The second round finds the prompts' blocks cached, the head's K/V in them too."""
    RecordingEagle3.answers = {}
    engine = recording_engine(target_dir, head_dir, 4)
    for _ in range(2):
        RecordingEagle3.records = []
        outputs, _ = generate(engine, PROMPTS, testing.greedy(MAX_TOKENS))
        assert outputs == expected_greedy
    assert engine.get_stats().prefix_cache_hits > 0
    reference = ReferenceEagle3(target_dir, head_dir)
    for history, guesses in RecordingEagle3.records:
        assert guesses == reference.guesses(history, 4)[:len(guesses)], f"after {history}"


def test_eagle3_needs_a_target_that_keeps_its_streams(target_dir, head_dir):
    with pytest.raises(ValueError, match="does not keep the hidden states an EAGLE-3 head reads"):
        make_engine(target_dir, {"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": 2},
                    model_impl="transformers")


def test_eagle3_refuses_a_model_that_is_not_a_head(target_dir):
    with pytest.raises(ValueError, match="is not an EAGLE-3 head"):
        make_engine(target_dir, {"method": "eagle3", "model": str(target_dir), "num_speculative_tokens": 2})


def test_tensor_parallel_ranks_run_the_head_alike(target_dir, head_dir, expected_greedy):
    """Two gloo ranks, the head sharded as the target: the tokens of one process."""
    outputs, (drafted, _) = greedy_run(target_dir, {"method": "eagle3", "model": str(head_dir),
                                                    "num_speculative_tokens": 3}, tensor_parallel_size=2)
    assert outputs == expected_greedy
    assert drafted > 0


def test_serving_a_head_alone_is_refused_naming_what_it_is(head_dir):
    with pytest.raises(ValueError, match=r"is a speculative decoding head \(LlamaForCausalLMEagle3\)"):
        make_engine(head_dir, None)


def test_a_head_reading_layers_the_target_lacks_is_refused(target_dir, head_dir, tmp_path):
    import shutil

    shutil.copytree(head_dir, tmp_path / "head")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [0, 2, 7]
    (tmp_path / "head" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"the head reads target layers \[0, 2, 7\], the target has 4"):
        make_engine(target_dir, {"method": "eagle3", "model": str(tmp_path / "head"), "num_speculative_tokens": 2})
