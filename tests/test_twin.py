"""The MLX twin of the real chat model (macserve/dev/gguf_twin.py, `macserve dev twin`):
SmolLM2-135M-Instruct's Q4_1 GGUF turned into an mlx-lm Llama checkpoint.

- its config.json says what the GGUF's header says (read by inspect's own header reader, not
  by the converter's);
- llama.cpp's Q/K row permutation is undone exactly: the twin's logits equal those of the
  GGUF's row order run with llama.cpp's rotation (adjacent pairs, `rope_traditional`), and the
  rows left permuted give other logits;
- against the real llama-server on the GGUF: teacher-forced greedy next tokens agree, and not
  with the rows left permuted; its tokenizer gives llama-server's token ids on multi-byte text;
- the chat template renders the system prompt (the model's own default when none is given),
  ends with the assistant header, and the end of turn `<|im_end|>` is the EOS mlx-lm stops on;
- bad input: one-line errors, no half-written checkpoint.

`macserve bench twin` prints the agreement on more prompts (docs/real-model.md).
"""

import json

import gguf as gguf_py
import httpx
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.llama import Model, ModelArgs
from mlx_lm.utils import load

from macserve.dev import gguf_twin, twin_bench
from macserve.errors import MacserveError
from macserve.sizing.gguf_header import read_gguf_metadata

from .fixtures import need_llama_server

# A raw text (no template): a short sequence whose greedy next tokens are mostly decided.
TEXT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"
MULTIBYTE = [
    "Hello 世界 🙂 naïve café",
    "日本語のテキスト、絵文字 👩‍💻🚀 と数字 2024",
    "Ελληνικά и русский",
]


@pytest.fixture(scope="module")
def twin(smollm_twin):
    return load(str(smollm_twin))


def _model_from(weights: dict, cfg: dict, traditional: bool) -> Model:
    args = ModelArgs.from_dict({**cfg, "rope_traditional": traditional})
    m = Model(args)
    m.load_weights(list(weights.items()))
    mx.eval(m.parameters())
    return m


@pytest.fixture(scope="module")
def permuted(smollm_gguf, smollm_twin):
    """The twin's weights with llama.cpp's row order left in, float32."""
    tensors, _ = gguf_twin.read(smollm_gguf)
    cfg = json.loads((smollm_twin / "config.json").read_text())
    cfg.pop("quantization", None)
    return gguf_twin.mlx_weights(tensors, cfg, "float32", undo_permutation=False), cfg


@pytest.mark.model
def test_config_says_what_the_gguf_header_says(smollm_gguf, smollm_twin):
    with open(smollm_gguf, "rb") as f:
        meta, _ = read_gguf_metadata(f)
    cfg = json.loads((smollm_twin / "config.json").read_text())
    assert cfg["model_type"] == "llama" == meta["general.architecture"]
    for field, key in [
        ("hidden_size", "llama.embedding_length"),
        ("intermediate_size", "llama.feed_forward_length"),
        ("num_hidden_layers", "llama.block_count"),
        ("num_attention_heads", "llama.attention.head_count"),
        ("num_key_value_heads", "llama.attention.head_count_kv"),
        ("max_position_embeddings", "llama.context_length"),
        ("head_dim", "llama.rope.dimension_count"),
        ("rope_theta", "llama.rope.freq_base"),
        ("rms_norm_eps", "llama.attention.layer_norm_rms_epsilon"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
    ]:
        assert cfg[field] == pytest.approx(meta[key]), field
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # GQA carried over
    # no output.weight in the GGUF: the head is the embedding
    assert cfg["tie_word_embeddings"] is True
    tok = json.loads((smollm_twin / "tokenizer.json").read_text())
    assert len(tok["model"]["vocab"]) == cfg["vocab_size"]


@pytest.mark.model
def test_permutation_undone_exactly(twin, permuted):
    """Llama.cpp's rows with its own rotation (adjacent pairs) are the same function as the
    twin's rows with Hugging Face's (halves): logits agree to float32 rounding. The rows left
    permuted under the halves rotation (the bug the unpermute prevents) give other logits."""
    model, tok = twin
    weights, cfg = permuted
    ids = mx.array([tok.encode(TEXT)])
    want = model(ids)
    same = _model_from(weights, cfg, traditional=True)(ids)
    wrong = _model_from(weights, cfg, traditional=False)(ids)
    scale = float(mx.abs(want).max())
    assert float(mx.abs(same - want).max()) < 1e-3 * scale
    assert float(mx.abs(wrong - want).max()) > 0.05 * scale
    # and greedy decoding reads other tokens
    assert bool(mx.any(mx.argmax(wrong, -1) != mx.argmax(want, -1)))


@pytest.fixture(scope="module")
def server_url(smollm_gguf, tmp_path_factory):
    binary = need_llama_server()
    log = tmp_path_factory.mktemp("twin-llama") / "llama-server.log"
    with twin_bench.llama_server(binary, smollm_gguf, ctx=1024, log=log) as url:
        yield url


@pytest.mark.e2e
def test_teacher_forced_agreement_with_llama_server(llama_server, server_url, twin, permuted):
    """At every position of TEXT, llama-server's greedy next token against the twin's argmax:
    all agree but for near ties (llama-server's own top two within NEAR_TIE nats, where its
    8-bit activations can flip the order), and the two log-probabilities of llama's token stay
    within NEAR_TIE. With the rows left permuted, they do not."""
    model, tok = twin
    ids = tok.encode(TEXT)
    with httpx.Client() as client:
        ref = twin_bench.llama_next(client, server_url, ids)
    want = [a for a, _, _ in ref]
    mine, mine_lp = twin_bench.mlx_next(model, ids, want)
    agree, near, gap = twin_bench.judge(ref, mine, mine_lp)
    assert agree + near == len(ref), list(zip(want, mine))
    assert agree >= len(ref) // 2, "too few decided positions to judge"
    assert gap < twin_bench.NEAR_TIE
    weights, cfg = permuted
    wrong = _model_from(weights, cfg, traditional=False)
    _, _, wrong_gap = twin_bench.judge(ref, *twin_bench.mlx_next(wrong, ids, want))
    assert wrong_gap > twin_bench.NEAR_TIE


@pytest.mark.e2e
def test_tokenizer_gives_llama_servers_ids(llama_server, server_url, twin):
    _, tok = twin
    with httpx.Client() as client:
        for text in [*MULTIBYTE, TEXT + " 1234567", "<|im_start|>user\nhi<|im_end|>\n"]:
            r = client.post(server_url + "/tokenize", json={"content": text, "parse_special": True})
            ids = tok.encode(text, add_special_tokens=False)
            assert ids == r.json()["tokens"], text
            assert tok.decode(ids) == text


@pytest.mark.model
def test_chat_template_and_end_of_turn(twin, smollm_twin):
    _, tok = twin
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token == "<|im_end|>"
    assert set(tok.eos_token_ids) == {im_end}  # what mlx-lm stops generating on
    assert json.loads((smollm_twin / "config.json").read_text())["eos_token_id"] == im_end
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    mine = tok.apply_chat_template(
        [{"role": "system", "content": "Answer in French."}, *msgs],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert mine.startswith("<|im_start|>system\nAnswer in French.<|im_end|>\n")
    assert mine.endswith("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")
    default = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert default.startswith("<|im_start|>system\nYou are a helpful AI assistant")
    # the special tokens stay whole: one id each, never spelled out in pieces
    ids = tok.encode(mine, add_special_tokens=False)
    assert ids.count(im_end) == 2 and ids[0] == tok.convert_tokens_to_ids("<|im_start|>")


def _gguf(path, arch):
    """A GGUF of one tensor and no hyperparameters: an architecture and nothing else."""
    w = gguf_py.GGUFWriter(str(path), arch)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.model
def test_bad_input_is_one_line_and_writes_nothing(tmp_path):
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"not a gguf at all")
    with pytest.raises(MacserveError, match="cannot read this GGUF"):
        gguf_twin.convert(not_gguf, tmp_path / "out1")
    other = _gguf(tmp_path / "qwen.gguf", "qwen2")
    with pytest.raises(MacserveError, match="reads Llama GGUFs; this one is 'qwen2'") as e:
        gguf_twin.convert(other, tmp_path / "out2")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out2").exists()
    bare = _gguf(tmp_path / "bare.gguf", "llama")
    with pytest.raises(MacserveError, match="no llama.attention.head_count"):
        gguf_twin.convert(bare, tmp_path / "out4")
    assert not (tmp_path / "out4").exists()
    with pytest.raises(MacserveError, match="dtype 'int3'"):
        gguf_twin.convert(other, tmp_path / "out3", "int3")
