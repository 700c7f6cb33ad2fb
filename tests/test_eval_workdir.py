"""A run's config, re-resolved for inference on another mesh."""

import jax
import pytest

from mtnlg_jax import config as config_lib
from mtnlg_jax.eval import workdir as workdir_lib


@pytest.mark.parametrize('data,tensor', [(None, None), (1, 8), (8, 1)])
def test_the_default_runs_config_resolves_for_inference_on_any_mesh(data, tensor):
    """configs/tiny.py trains with a pipeline and a batch-size ramp-up; inference has neither,
    keeps the checkpoint's padded vocabulary and takes any data x tensor mesh."""
    saved = config_lib.resolve(config_lib.load('configs/tiny.py'), jax.device_count()).to_dict()
    config = workdir_lib.inference_config(saved, data, tensor)
    assert (config.mesh.stage, config.pipeline.repeats) == (1, 1)
    assert config.train.to_dict() == config_lib.load('configs/tiny.py').train.to_dict()  # as given
    assert config.mesh.tensor == (tensor or saved['mesh']['tensor'])
    assert config.model.padded_vocab == saved['derived']['model']['padded_vocab']


@pytest.mark.parametrize('context', [1, 2])
def test_a_context_parallel_runs_config_resolves_for_inference_on_the_context_asked(context):
    """configs/tiny_llama_8k.py trains on context 4 x tensor 2: inference takes the mesh's
    context from its caller (1 by default; generation's prefill splits over it), not the
    run's."""
    saved = config_lib.resolve(config_lib.load('configs/tiny_llama_8k.py'), 8).to_dict()
    config = workdir_lib.inference_config(saved, 1, 2, context)
    assert (config.mesh.data, config.mesh.context, config.mesh.tensor) == (1, context, 2)
