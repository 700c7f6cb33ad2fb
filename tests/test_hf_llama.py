"""Hugging Face Llama in and out (mtnlg_jax/interop/hf_llama.py, launch/convert.py), against a
small random LlamaForCausalLM that transformers itself saved, with transformers' logits
(tests/fixtures/hf_llama, made by make_fixture.py there)."""

import json
import pathlib
import shutil

import ml_collections
import numpy as np
import pytest

from mtnlg_jax.interop import hf_llama
from mtnlg_jax.interop import safetensors_files as st

FIXTURE = pathlib.Path(__file__).resolve().parent / 'fixtures' / 'hf_llama'
LLAMA31_CONFIG = json.loads((FIXTURE / 'llama31_config.json').read_text())
TRANSFORMERS_CONFIG = json.loads((FIXTURE / 'llama' / 'config.json').read_text())
PADDED_VOCAB = 384
# Our parameters of the fixture's Llama (GQA: q and kv apart; untied: output_embed).
PATHS = [
    ('token_embed',),
    ('output_embed',),
    ('final_norm', 'scale'),
    ('blocks', 'ln_attn', 'scale'),
    ('blocks', 'ln_mlp', 'scale'),
    ('blocks', 'attention', 'q_kernel'),
    ('blocks', 'attention', 'kv_kernel'),
    ('blocks', 'attention', 'out_kernel'),
    ('blocks', 'mlp', 'gate_kernel'),
    ('blocks', 'mlp', 'in_kernel'),
    ('blocks', 'mlp', 'out_kernel'),
]


def fixture_model_cfg():
    return ml_collections.ConfigDict(
        dict(hf_llama.model_keys(TRANSFORMERS_CONFIG), padded_vocab=PADDED_VOCAB, seq_len=64)
    )


def llama31_dir(tmp_path):
    """The fixture's weights beside the config.json the published Llama 3.1 checkpoints carry."""
    directory = tmp_path / 'llama31'
    shutil.copytree(FIXTURE / 'llama', directory)
    shutil.copy(FIXTURE / 'llama31_config.json', directory / 'config.json')
    return directory


def test_both_config_layouts_give_the_same_model_keys():
    keys = hf_llama.model_keys(TRANSFORMERS_CONFIG)
    assert 'rope_parameters' in TRANSFORMERS_CONFIG and 'rope_scaling' in LLAMA31_CONFIG
    assert hf_llama.model_keys(LLAMA31_CONFIG) == keys
    assert keys['rope_scaling'] == dict(
        type='llama3', factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context=16
    )
    assert (keys['heads'], keys['kv_heads'], keys['head_dim'], keys['tie_embeddings']) == (
        4, 2, 8, False
    )  # fmt: skip
    assert (keys['rope_theta'], keys['norm'], keys['mlp'], keys['bias']) == (
        500000.0, 'rmsnorm', 'swiglu', False
    )  # fmt: skip


def test_our_export_config_reads_back_into_the_same_model_keys():
    cfg = fixture_model_cfg()
    cfg.update(dict(attention_dropout=0.0, init_std=0.02))
    exported = hf_llama.hf_config_of(cfg, bos_id=318, eos_id=319)
    assert hf_llama.model_keys(exported) == hf_llama.model_keys(TRANSFORMERS_CONFIG)


@pytest.mark.parametrize(
    'change, message',
    [
        (dict(hidden_act='gelu'), 'only silu'),
        (dict(rope_scaling=dict(rope_type='yarn', factor=4.0)), "rope type 'yarn'"),
        (dict(attention_bias=True), 'attention_bias and mlp_bias differ'),
        (dict(model_type='mistral', architectures=['MistralForCausalLM']), 'not a Llama'),
        (dict(hidden_size=None), 'no integer hidden_size'),
    ],
)
def test_configs_we_cannot_express_are_refused_with_the_reason(change, message):
    with pytest.raises(hf_llama.HFFormatError, match=message):
        hf_llama.model_keys(dict(LLAMA31_CONFIG, **change))


def read_all(directory, cfg):
    with st.Reader(directory) as reader:
        return {path: hf_llama.read_leaf(reader, path, cfg, PADDED_VOCAB, ()) for path in PATHS}


def test_hf_tensors_to_ours_and_back_are_bit_exact_from_either_file_layout():
    cfg = fixture_model_cfg()
    ours = read_all(FIXTURE / 'llama_sharded', cfg)
    assert ours[('blocks', 'attention', 'kv_kernel')].shape == (4, 32, 2, 2, 8)
    assert ours[('token_embed',)].shape == (PADDED_VOCAB, 32)
    assert not ours[('token_embed',)][320:].any()  # the padded rows are zero

    def get(path, layer):
        return ours[path] if layer is None else ours[path][layer]

    back = dict(hf_llama.hf_tensors(PATHS, get, cfg))
    with st.Reader(FIXTURE / 'llama') as reader:
        assert sorted(back) == reader.names()
        for name, value in back.items():
            np.testing.assert_array_equal(value, reader.read(name).astype(np.float32))
    first = list(back)[:2]
    assert first == ['model.embed_tokens.weight', 'model.layers.0.input_layernorm.weight']


def test_q_and_k_rows_map_head_by_head_as_rotate_half_pairs_them():
    """Our q_kernel[e, h, d] is q_proj[h * D + d, e]: no rope permutation, since our rope
    pairs channel d with d + D / 2 as Hugging Face's rotate_half does (model/rope.py)."""
    cfg = fixture_model_cfg()
    with st.Reader(FIXTURE / 'llama') as reader:
        q = reader.read('model.layers.1.self_attn.q_proj.weight').astype(np.float32)
        k = reader.read('model.layers.1.self_attn.k_proj.weight').astype(np.float32)
        ours_q = hf_llama.read_leaf(reader, PATHS[5], cfg, PADDED_VOCAB, (slice(1, 2),))[0]
        ours_kv = hf_llama.read_leaf(reader, PATHS[6], cfg, PADDED_VOCAB, (slice(1, 2),))[0]
    np.testing.assert_array_equal(ours_q[5, 3, 6], q[3 * 8 + 6, 5])
    np.testing.assert_array_equal(ours_kv[7, 0, 1, 2], k[1 * 8 + 2, 7])


@pytest.mark.parametrize('path', PATHS)
def test_a_devices_slice_reads_as_that_slice_of_the_whole_leaf(path):
    cfg = fixture_model_cfg()
    whole = read_all(FIXTURE / 'llama', cfg)[path]
    rng = np.random.default_rng(len(path[-1]))
    with st.Reader(FIXTURE / 'llama') as reader:
        for _ in range(4):
            index = []
            for n in whole.shape:
                start = int(rng.integers(0, n))
                index.append(slice(start, int(rng.integers(start + 1, n + 1))))
            part = hf_llama.read_leaf(reader, path, cfg, PADDED_VOCAB, tuple(index))
            np.testing.assert_array_equal(part, whole[tuple(index)])
