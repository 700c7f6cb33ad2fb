"""Tiny mixture of experts for CPU development: configs/tiny_llama.py's run and block with
the MLP replaced by a shared expert and 8 routed SwiGLU experts, each token routed to 2
(model/moe.py, docs/models.md).

DeepSeekMoE's layout at tiny_llama's active parameters: one shared expert 528 wide (every
token, weight 1) and 8 routed experts 88 wide, so the shared expert and a token's two routed
experts are 528 + 2 x 88 = 704, tiny_llama's MLP (the router adds 256 x 8 a layer); total MLP
parameters 1.75 times. Softmax router renormalised over the two, the two weights times 2
(model.moe.routed_scale: the routed pair sums like the dense MLP's parts instead of averaging),
Switch's load-balancing loss at 0.01, dropless. Measured (docs/benchmarks.md, "The tiny MoE"):
kjv valid 4.2708 after 700 steps against tiny_llama's 4.2776 (4.2784 trained on one device:
the margin is within what another run's routing moves, so level with it); 8 routed experts of
352 and no shared expert reach 4.3259, a shared expert of 352 beside 8 of 176 4.2788. Mesh
data 2 x stage 2 x tensor 2 as tiny; the experts are whole on every rank (mesh.expert 1) and
split over tensor.

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
            ffn_hidden=88,
            shared_experts=1,
            shared_ffn_hidden=528,
            router='softmax',
            norm_top_k=True,
            routed_scale=2.0,
            aux_loss_coeff=0.01,
        )
    )
    return config
