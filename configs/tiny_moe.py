"""Tiny mixture of experts for CPU development: configs/tiny_llama.py's run and block with
the MLP replaced by 8 SwiGLU experts, each token routed to 2 (model/moe.py, docs/models.md).

Each expert is 352 wide, half of tiny_llama's 704, so a token's two experts do the work of its
dense MLP: active parameters about tiny_llama's (the router adds 256 x 8 a layer), total
MLP parameters 4 times. Softmax router renormalised over the two (Mixtral's), Switch's
load-balancing loss at 0.01, dropless. Mesh data 2 x stage 2 x tensor 2 as tiny; the experts
are whole on every rank (mesh.expert 1) and split 176 a rank over tensor.

    make train CONFIG=configs/tiny_moe.py      # workdir runs/tiny_moe
"""

import pathlib

from mtnlg_jax import config as config_lib


def get_config():
    config = config_lib.load(str(pathlib.Path(__file__).with_name('tiny_llama.py')))
    config.model.moe.update(
        dict(
            experts=8,
            top_k=2,
            ffn_hidden=352,
            router='softmax',
            norm_top_k=True,
            aux_loss_coeff=0.01,
        )
    )
    return config
