"""The GGUF reader and tokenizer builder: on a tiny Llama written the way llama.cpp lays files out, and
on the real SmolLM2 file against transformers' own GGUF conversion (config, tokenizer, every tensor)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from tandem_engine.models import loader
from tandem_engine.models.gguf_file import GGUFFile, _Header
from tandem_engine.models.gguf_tokenizer import build_tokenizer, builds_tokenizer
from tests.engine.models.utils import TINY, tiny_weights, write_tiny_gguf
from tests.engine.utils import read_only

Q = GGMLQuantizationType


def test_dense_tensors_are_ours_in_hf_row_order(tmp_path: Path) -> None:
    weights = tiny_weights(tie=False)
    f = GGUFFile(write_tiny_gguf(tmp_path / "tiny.gguf", weights))
    assert sorted(f.tensor_names()) == sorted(weights)
    for name, want in weights.items():
        got = f.dense(name)
        assert got.dtype == torch.float32 and torch.equal(got, want), name  # q/k permutation undone
    assert f.config_fields()["tie_word_embeddings"] is False


def test_config_fields_from_metadata(tmp_path: Path) -> None:
    f = GGUFFile(write_tiny_gguf(tmp_path / "tiny.gguf", tiny_weights()))
    c = f.config_fields()
    assert (c["vocab_size"], c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]) == (
        TINY["vocab"], TINY["hidden"], TINY["intermediate"], TINY["layers"])
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (6, 3, 16)
    assert c["rope_parameters"] == {"rope_type": "default", "rope_theta": 50000.0}
    assert c["max_position_embeddings"] == TINY["context"] and c["tie_word_embeddings"] is True
    assert (c["bos_token_id"], c["eos_token_id"]) == (1, 2) and "pad_token_id" not in c
    assert c["rms_norm_eps"] == pytest.approx(1e-5)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1])
def test_raw_quantized_rows_match_dense(tmp_path: Path, qtype: GGMLQuantizationType) -> None:
    weights = tiny_weights()
    quantized = [n for n in weights if n.endswith("_proj.weight")] + ["model.embed_tokens.weight"]
    f = GGUFFile(write_tiny_gguf(tmp_path / "tiny.gguf", weights, dict.fromkeys(quantized, qtype)))
    block_bytes = {Q.Q8_0: 34, Q.Q4_1: 20}[qtype]
    tolerance = {Q.Q8_0: 0.01, Q.Q4_1: 0.15}[qtype]  # of the weights' range, per block
    for name in quantized:
        raw, dense = f.raw(name), f.dense(name)
        rows, cols = weights[name].shape
        assert raw.qtype == qtype and raw.shape == (rows, cols) and dense.shape == (rows, cols)
        assert raw.data.dtype == torch.uint8 and tuple(raw.data.shape) == (rows, cols // 32 * block_bytes)
        # The raw rows are in the dense tensor's order: dequantizing them gives it bit for bit.
        again = torch.from_numpy(np.array(dequantize(raw.data.numpy(), qtype)))
        assert torch.equal(again, dense), name
        # And the dense tensor is the original, up to the quantization step (rows in HF order).
        span = weights[name].abs().max().item()
        torch.testing.assert_close(dense, weights[name], atol=tolerance * span, rtol=0)
    assert f.raw("model.norm.weight").qtype == Q.F32


def reader_view(path: Path) -> tuple[dict[str, Any], list[tuple[str, int, tuple[int, ...], np.ndarray]]]:
    """What the gguf package's GGUFReader reads: metadata as plain values (without its own GGUF.* entries
    of the header counts), and each tensor's name, type, ggml shape and data view."""
    r = GGUFReader(path)

    def plain(v: Any) -> Any:
        return v.item() if isinstance(v, np.generic) else v

    meta = {k: [plain(x) for x in c] if isinstance(c := f.contents(), list) else plain(c)
            for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return meta, [(t.name, int(t.tensor_type), tuple(t.shape.tolist()), t.data) for t in r.tensors]


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_header_reads_as_the_gguf_package_reads_it(tmp_path: Path, which: str) -> None:
    """Our one-pass header parser against llama.cpp's reader: every metadata value (types included: str,
    int, float, bool, lists of them) and every tensor's name, type, shape and bytes."""
    if which == "tiny":
        weights = tiny_weights()
        quantized = dict.fromkeys([n for n in weights if n.endswith("_proj.weight")], Q.Q4_1)
        path = write_tiny_gguf(tmp_path / "tiny.gguf", weights, quantized)
    else:
        path = loader.resolve_model(loader.SMOLLM2_ALIAS).path
    header = _Header(path)
    meta, tensors = reader_view(path)
    assert header.metadata.keys() == meta.keys()
    for key, want in meta.items():
        got = header.metadata[key]
        assert got == want and type(got) is type(want), key
        if isinstance(want, list) and want:
            assert type(got[0]) is type(want[0]), key
    assert len(header.tensors) == len(tensors)
    for t, (name, qtype, shape, data) in zip(header.tensors, tensors, strict=True):
        assert (t.name, t.tensor_type, t.shape) == (name, qtype, shape)
        assert t.data.dtype == data.dtype and t.data.shape == data.shape and np.array_equal(t.data, data), name


def test_a_truncated_or_foreign_file_is_refused(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_weights())
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-64])
    with pytest.raises(ValueError, match="runs past the end"):
        GGUFFile(cut)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGML" + path.read_bytes()[4:])
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(other)


def test_unsupported_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        GGUFFile(write_tiny_gguf(tmp_path / "a.gguf", tiny_weights(), arch="gpt2"))
    f = GGUFFile(write_tiny_gguf(tmp_path / "b.gguf", tiny_weights(), **{"llama.rope.scaling.type": "yarn"}))
    with pytest.raises(ValueError, match="RoPE scaling 'yarn'"):
        f.config_fields()
    with pytest.raises(KeyError, match="no tensor"):
        f.dense("lm_head.weight")


def test_tiny_gguf_serves_through_the_loader(tmp_path: Path) -> None:
    """The cache built from a GGUF loads into our model with the file's weights and a working tokenizer."""
    weights = tiny_weights()
    path = write_tiny_gguf(tmp_path / "tiny.gguf", weights)
    src = loader.resolve_model(str(path), tmp_path / "cache")
    loaded = loader.load_model(src, torch.float32, onednn_pack=False)
    assert torch.equal(loaded.model.embed_tokens, weights["model.embed_tokens.weight"])
    assert loaded.model.tie_word_embeddings and loaded.eos_token_ids == [2]
    config, tok, gen = loader.load_config_and_tokenizer(src)
    assert config.num_key_value_heads == 3 and gen.get("eos_token_id") == 2
    # The engine reads the tokenizer's EOS from its files; the frontend loads the tokenizer.
    assert loaded.eos_token_ids == loader.eos_token_ids(config, tok, gen)
    assert tok.eos_token == "<|im_end|>" and tok.bos_token == "<|im_start|>"
    ids = tok("the cat<|im_end|>")["input_ids"]
    assert ids[-1] == 2 and tok.decode(ids, skip_special_tokens=True) == "the cat"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_engine_eos_ids_equal_the_frontends_for_a_vocabulary_eos(tmp_path: Path) -> None:
    """A model directory whose tokenizer's EOS is an ordinary vocabulary token, not an added one."""
    src = loader.resolve_model(str(write_tiny_gguf(tmp_path / "tiny.gguf", tiny_weights())), tmp_path / "cache")
    d = shutil.copytree(loader.weights_dir(src), tmp_path / "model")
    tok_config = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**tok_config, "eos_token": "Ġthe"}))
    as_dir = loader.resolve_model(str(d))
    config, tok, gen = loader.load_config_and_tokenizer(as_dir)
    want = loader.eos_token_ids(config, tok, gen)
    assert tok.eos_token == "Ġthe" and len(want) == 2
    assert loader.load_model(as_dir, torch.float32, onednn_pack=False).eos_token_ids == want


def test_read_only_cache_dir_builds_under_the_temp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_weights())
    baked, scratch = tmp_path / "baked", tmp_path / "tmp"
    baked.mkdir()
    read_only(monkeypatch, baked, scratch)
    src = loader.resolve_model(str(path), baked)
    d = loader.weights_dir(src)
    assert d.is_relative_to(scratch) and (d / "model.safetensors").is_file() and not list(baked.iterdir())
    mtime = (d / "model.safetensors").stat().st_mtime_ns
    assert loader.weights_dir(src) == d and (d / "model.safetensors").stat().st_mtime_ns == mtime


# --- the real file, against transformers' conversion -------------------------------------------------

PROMPTS = [
    "The capital of France is",
    "  leading spaces,\ttabs\nand\n\nnewlines   ",
    "Numbers 1 12 123 2024 3.14159 and -7e10",
    "Unicode: café, naïve, 日本語, emoji 🤖🚀, Ελληνικά",
    "def f(x):\n    return x ** 2  # code",
    "<|im_start|>user\nspecial tokens inline<|im_end|><|endoftext|>",
    "<repo_name>tandem<file_sep>README.md",
    "",
]
CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "Why?"}],
]


@pytest.fixture(scope="module")
def smollm2() -> GGUFFile:
    return GGUFFile(loader.resolve_model(loader.SMOLLM2_ALIAS).path)


def test_tokenizer_matches_transformers_conversion(smollm2: GGUFFile, tmp_path: Path) -> None:
    """Both as a cache holds them: saved, then loaded back as the engine loads them."""
    from transformers import AutoTokenizer

    path = smollm2.path
    assert builds_tokenizer(smollm2.metadata)
    build_tokenizer(smollm2.metadata).save_pretrained(tmp_path / "ours")
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tmp_path / "ref")
    ours: Any = AutoTokenizer.from_pretrained(tmp_path / "ours")
    ref: Any = AutoTokenizer.from_pretrained(tmp_path / "ref")
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "special_tokens_map",
                 "all_special_ids", "chat_template"):
        assert getattr(ours, attr) == getattr(ref, attr), attr
    assert ours.get_vocab() == ref.get_vocab()
    for text in PROMPTS:
        ids = ours(text)["input_ids"]
        assert ids == ref(text)["input_ids"], text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    for chat in CHATS:
        for gen in (False, True):
            kw: dict[str, Any] = {"add_generation_prompt": gen}
            assert ours.apply_chat_template(chat, tokenize=False, **kw) == ref.apply_chat_template(
                chat, tokenize=False, **kw)
            assert ours.apply_chat_template(chat, **kw) == ref.apply_chat_template(chat, **kw)


def test_cache_equals_transformers_route(smollm2: GGUFFile) -> None:
    """Config and every tensor of the cache the engines load (the default cache dir: built here if no test
    built it before) are those transformers' GGUF route makes, bit for bit."""
    from transformers import AutoConfig, AutoModelForCausalLM, GgufConfig

    path = smollm2.path
    d = loader.weights_dir(loader.resolve_model(str(path)))
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                               quantization_config=GgufConfig(dequantize=True))

    def plain(c: Any) -> dict[str, Any]:  # the file's config, without bookkeeping or the loaded dtype
        return {k: v for k, v in c.to_dict().items()
                if not k.startswith("_") and k not in ("transformers_version", "dtype")}

    assert plain(AutoConfig.from_pretrained(d)) == plain(ref.config)
    state = dict(loader.iter_safetensors(d))
    want = {k: v for k, v in ref.state_dict().items() if k != "lm_head.weight"}  # tied: not stored
    assert sorted(state) == sorted(want)
    for name, t in want.items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], t), name
