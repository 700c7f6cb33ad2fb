"""The shipped configs: the papers' shapes and the paper's FLOPs arithmetic."""

import glob
import re

import pathlib

import jax
import ml_collections
import pytest
from flax import nnx

from mtnlg_jax import config as config_lib
from mtnlg_jax.config import keys
from mtnlg_jax.plan import arithmetic
from mtnlg_jax.model import counts
from mtnlg_jax.xla import devices
from mtnlg_jax.model import gpt


def _param_count(path):
    """Parameters of a config's model, counted on abstract shapes (nothing is allocated)."""
    config = config_lib.load(path)
    config.mesh.update(dict(data=1, stage=1, expert=1))  # one replica, one stage: tensor only
    config.pipeline.update(dict(repeats=1, schedule='1f1b'))
    config.train.global_batch = config.train.micro_batch
    config.train.rampup.start = 0  # one sequence per step: no room for a ramp
    config = config_lib.resolve(config, config.mesh.tensor)
    abstract = nnx.eval_shape(lambda: gpt.create(config.model, 0))
    return counts.count_params(gpt.split(abstract)[1]), config


@pytest.mark.parametrize(
    'path,expected',
    [
        ('configs/gpt2_124m.py', 124.4e6),  # GPT-2 small: 124.4 M with the 50257 vocabulary
        ('configs/megatron_8_3b.py', 8.3e9),  # Megatron-LM 2019
        ('configs/mtnlg_530b.py', 529.6e9),  # MT-NLG: about 529.6 B
        ('configs/llama3_8b.py', 8.03e9),  # Llama 3: 8.03 B, 70.55 B, 405.85 B (Hugging Face)
        ('configs/llama3_70b.py', 70.55e9),
        ('configs/llama3_405b.py', 405.85e9),
        # Hugging Face's checkpoints: 46.70 B, 140.62 B, 30.53 B, 235.09 B (the padded
        # vocabulary adds at most 0.02 %)
        ('configs/mixtral_8x7b.py', 46.70e9),
        ('configs/mixtral_8x22b.py', 140.62e9),
        ('configs/qwen3_30b_a3b.py', 30.53e9),
        ('configs/qwen3_235b_a22b.py', 235.09e9),
    ],
)
def test_paper_configs_have_the_papers_parameter_counts(path, expected):
    count, _ = _param_count(path)
    rounding = 0.01 if 'gpt2' in path or '8_3b' in path or '530b' in path else 0.001
    assert abs(count - expected) / expected < rounding, f'{count:,} parameters'


@pytest.mark.parametrize(
    'path, active',
    [
        ('configs/mixtral_8x7b.py', 12.88e9),  # Mistral's 13 B, Qwen's 3.3 B and 22 B
        ('configs/mixtral_8x22b.py', 39.15e9),
        ('configs/qwen3_30b_a3b.py', 3.35e9),
        ('configs/qwen3_235b_a22b.py', 22.19e9),
    ],
)
def test_moe_configs_have_the_published_active_parameters(path, active):
    count, config = _param_count(path)
    assert counts.active_params(config.model, count) == pytest.approx(active, rel=0.002)


def test_mtnlg_vocabulary_pads_to_51200_under_tensor_8():
    _, config = _param_count('configs/mtnlg_530b.py')
    assert config.model.padded_vocab == 51200
    assert config.model.hidden // config.model.heads == 160


@pytest.mark.parametrize(
    'nodes,iteration_s,tflops', [(280, 60.1, 125.7), (350, 50.2, 120.4), (420, 44.4, 113.5)]
)
def test_megatron_flops_formula_reproduces_the_mtnlg_table(nodes, iteration_s, tflops):
    _, config = _param_count('configs/mtnlg_530b.py')
    flops = arithmetic.megatron_flops_per_step(config.model, global_batch=1920, recompute=True)
    assert flops / (iteration_s * nodes * 8) / 1e12 == pytest.approx(tflops, abs=0.1)


# configs/workdir.py is not an experiment: it reads a workdir's config.json.
@pytest.mark.parametrize('path', sorted(set(glob.glob('configs/*.py')) - {'configs/workdir.py'}))
def test_every_config_loads_with_every_key_known(path):
    config = config_lib.load(path)
    defaults = config_lib.defaults()
    for section in config.keys():
        assert set(config[section].keys()) <= set(defaults[section].keys()), section


def test_tiny_config_resolves_on_eight_devices():
    config = config_lib.resolve(config_lib.load('configs/tiny.py'), 8)
    assert (config.mesh.data, config.mesh.stage, config.mesh.tensor) == (2, 2, 2)
    assert config.pipeline.repeats == 2
    assert config.train.micro_steps == 2
    assert config.model.compute_dtype == 'float32'
    count, _ = _param_count('configs/tiny.py')
    assert 1e6 < count < 10e6


def test_tiny_moe_resolves_with_about_tiny_llamas_active_parameters():
    """A shared expert of 3/4 tiny_llama's MLP width and 8 routed of 1/8, 2 a token:
    within 1 % of its parameters active (the routers add 256 x 8 a layer), and in all the
    experts hold 1.75 times its MLPs (4 layers of 3 matrices 256 x 704), the routers besides."""
    moe, config = _param_count('configs/tiny_moe.py')
    llama, _ = _param_count('configs/tiny_llama.py')
    active = counts.active_params(config.model, moe)
    assert active == pytest.approx(llama, rel=0.01)
    assert moe - llama == 0.75 * 4 * 3 * 256 * 704 + 4 * 256 * 8
    assert config_lib.resolve(config_lib.load('configs/tiny_moe.py'), 8).model.moe.experts == 8


def test_device_peak_table():
    cpu = jax.devices()[0]
    assert devices.device_peak_tflops(cpu, 'bfloat16') is None

    class FakeDevice:
        device_kind = 'NVIDIA H100 80GB HBM3'

    assert devices.device_peak_tflops(FakeDevice(), 'bfloat16') == 989.0


def test_minus_one_fills_the_mesh_with_the_remaining_devices():
    config = config_lib.load('configs/tiny.py')
    config.mesh.update(dict(data=-1, stage=2, tensor=2))
    assert config_lib.resolve(config, 8).mesh.data == 2
    config.mesh.update(dict(data=2, stage=1, tensor=-1))
    assert config_lib.resolve(config, 8).mesh.tensor == 4


@pytest.mark.parametrize(
    'vocab,tensor,padded', [(50257, 1, 50304), (50257, 8, 51200), (8192, 2, 8192), (1000, 4, 1024)]
)
def test_vocabulary_pads_to_a_multiple_of_128_x_tensor(vocab, tensor, padded):
    assert config_lib.padded_vocab_size(vocab, tensor) == padded


def test_resolve_never_changes_the_users_config_and_keeps_derived_values_apart():
    config = config_lib.load('configs/tiny.py')
    given = config.to_dict()
    resolved = config_lib.resolve(config, 8)
    assert config.to_dict() == given
    assert 'micro_steps' not in config.train and 'padded_vocab' not in config.model  # not inputs
    assert resolved.derived.train.micro_steps == resolved.train.micro_steps == 2
    assert resolved.derived.model.padded_vocab == resolved.model.padded_vocab == 8192
    assert 'derived' not in resolved.inputs and resolved.inputs.model.ffn_hidden == 0


@pytest.mark.parametrize('seq_len,pieces', [(1024, 4), (1023, 3), (1022, 2), (1021, 1)])
def test_loss_chunks_zero_takes_the_largest_of_4_3_2_1_dividing_the_sequence(seq_len, pieces):
    """The default never fails a sequence length (an imported model's n_positions, say); a
    given count must divide it (tests/test_train_command_line.py)."""
    config = config_lib.defaults()
    config.mesh.data = 1
    config.model.seq_len = seq_len
    resolved = config_lib.resolve(config, 1)
    assert resolved.model.loss_chunks == resolved.derived.model.loss_chunks == pieces
    assert resolved.inputs.model.loss_chunks == 0


@pytest.mark.parametrize(
    'key,value',
    [
        ('train.hang_timeout_s', -1),
        ('train.hang_floor_s', 0),
        ('train.inject_hang_process', -2),
        ('checkpoint.on_save_error', 'retry'),
        ('checkpoint.inject_save_error_at_step', -3),
        ('train.profile_start', -1),
        ('train.profile_steps', 0),
        ('train.straggler_ratio', 1.0),
    ],
)
def test_fault_keys_are_checked_naming_the_key(key, value):
    config = config_lib.load('configs/tiny.py')
    section, name = key.split('.')
    config[section][name] = value
    with pytest.raises(config_lib.ConfigError, match=f'config key {re.escape(key)}: '):
        config_lib.resolve(config, 8)


def test_the_cli_page_shows_the_key_table():
    page = (pathlib.Path(__file__).resolve().parents[1] / 'docs' / 'cli.md').read_text()
    assert keys.markdown() in page, 'paste keys.markdown() into docs/cli.md, "Config keys"'


def test_defaults_are_the_key_table():
    flat = {}

    def walk(section, prefix):
        for name, value in section.items():
            if hasattr(value, 'items'):
                walk(value, f'{prefix}{name}.')
            else:
                flat[f'{prefix}{name}'] = value

    walk(config_lib.defaults(), '')
    assert flat == {key.name: key.default for key in keys.KEYS}
    assert {key.resume for key in keys.KEYS} <= {'free', 'explicit', 'never'}


@pytest.mark.parametrize(
    'key, value, message',
    [
        ('model.remat', 'some', "'some' is not one of none, full, selective"),
        ('train.eval_every', -1, 'must be an integer >= 0, got -1'),
        ('model.hidden_dropout', 1.0, 'must be in [0, 1), got 1.0'),
        ('model.sequence_parallel', 1, 'must be True or False, got 1'),
        ('train.steps', True, 'must be a positive integer, got True'),
    ],
)
def test_a_key_checks_its_own_values_from_the_table(key, value, message):
    config = config_lib.defaults().to_dict()
    section, name = key.split('.')
    config[section][name] = value
    with pytest.raises(config_lib.ConfigError, match=re.escape(f'{key}: {message}')):
        config_lib.resolve(ml_collections.ConfigDict(config), 8)


def test_xla_options_are_name_value_words_as_in_xla_flags():
    train = ml_collections.ConfigDict(dict(xla_options=' --xla_a=1  xla_b_c=x,y xla_d=false'))
    assert config_lib.xla_options(train) == {'xla_a': '1', 'xla_b_c': 'x,y', 'xla_d': False}
    assert config_lib.xla_options(ml_collections.ConfigDict(dict(xla_options=''))) == {}


@pytest.mark.parametrize(
    'value, message',
    [
        ('xla_a=1 b=2', "'b=2' is not xla_NAME=VALUE"),
        ('xla_a', "'xla_a' is not xla_NAME=VALUE"),
        ('xla_a=1 --xla_a=2', 'xla_a is given twice'),
    ],
)
def test_xla_options_not_name_value_are_refused_naming_the_key(value, message):
    config = config_lib.defaults()
    config.train.xla_options = value
    with pytest.raises(config_lib.ConfigError, match=re.escape(f'train.xla_options: {message}')):
        config_lib.resolve(config, 8)
