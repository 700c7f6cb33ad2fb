"""Mixtral 8x7B (arXiv 2401.04088; Hugging Face mistralai/Mixtral-8x7B-v0.1's config.json):
the Llama block with 8 SwiGLU experts in place of each MLP, every token routed to 2.

32 layers, hidden 4096, 32 query heads over 8 key/value heads (head dim 128), each expert
14336 wide, a softmax router renormalised over the two chosen (model.moe.norm_top_k),
RMSNorm (eps 1e-5), rope theta 1e6 without scaling, no biases, untied embeddings,
vocabulary 32000: 46.70 B parameters, 12.88 B active a token (the paper's 47 B / 13 B).
`launch/convert.py --import_hf` of the published checkpoint fixes the same model keys.

What differs from Mistral's run: Mistral published neither its recipe, data nor layout. The
recipe is configs/llama3_8b.py's (Llama 2's AdamW, 2,000 warm-up steps of 4 M tokens, cosine
to 10 %, Llama 3's 15 T tokens), at Llama 3 8B's peak LR 3e-4; sequence 8192 (the
published context is 32768); Switch's load-balancing loss at 0.02 (Hugging Face's
router_aux_loss_coef for Mixtral), and a capacity factor of 1.0 in place of dropless
(configs/mixtral_8x22b.py's reason: under expert parallelism the exchange's fixed buffers
would take experts / top_k = 4 times the chosen rows dropless).

Layout, for 256 H100s (`launch/plan.py --search --cluster h100-80gb --devices 256`, capacity,
selective recompute and sequence parallelism fixed, ranked it first of 13,803;
docs/benchmarks.md, "Mixtral 8x7B and Qwen3-30B-A3B: the search's layouts compiled"):
tensor 2 x expert 4 (the all-to-all over expert x tensor, 8 ranks, inside a node) x pipeline
4 (8 layers a stage, interleaved 8 chunks of one) x data -1 (8 on 256), micro-batch 1 (16
micro-steps), selective recompute, sequence parallelism and parallel folding
(model.moe.fold_tensor: the 8 experts whole over expert x tensor, one a rank). The layout it
replaces (tensor 8 x pipeline 4, expert 1, the experts split over tensor by their width) was
planned at 30.9 GiB "fits", but it takes model/moe.py's batched path, whose gathered weight
copies the plan does not count (the 8x22B's such layout: 108.1 GiB compiled against 73.9
planned); never compiled. Compiled: 38.9 GiB a GPU (planned 40.4), 1.02 x model FLOPs,
exposed communication 19.4 % of compute (the stage hand-offs over the network 0.14 s, the
stage all-reduce's wait 0.10 s, the all-to-all 0.06 s), replayed 2.53 s, lockstep 2.63 s,
predicted 2.75 s, MFU 54.4 %; 15 T tokens at that step are 114 days:

    python launch/plan.py --config configs/mixtral_8x7b.py --devices 256 --target h100-80gb
"""

import pathlib

from mtnlg_jax import config as config_lib

MIXTRAL_BLOCK = dict(
    rope_theta=1e6,
    vocab_size=32000,
    layer_norm_epsilon=1e-5,
)
MIXTRAL_MOE = dict(
    experts=8,
    top_k=2,
    router='softmax',
    norm_top_k=True,
    aux_loss_coeff=0.02,
    capacity_factor=0.0,
)


def mixtral(shape, mesh):
    """configs/llama3_8b.py's block and recipe as Mixtral: `shape` (num_layers, hidden, heads,
    kv_heads, expert width), `mesh` ({axis: size})."""
    config = config_lib.load(str(pathlib.Path(__file__).with_name('llama3_8b.py')))
    layers, hidden, heads, kv_heads, width = shape
    config.model.update(dict(MIXTRAL_BLOCK, num_layers=layers, hidden=hidden, heads=heads,
                             kv_heads=kv_heads, ffn_hidden=width))  # fmt: skip
    config.model.rope_scaling.type = 'none'
    config.model.moe.update(dict(MIXTRAL_MOE, ffn_hidden=width))
    config.mesh.update(mesh)
    config.data.tokenizer = 'data/mixtral/tokenizer.json'  # Mistral's, as Hugging Face ships it
    return config


def get_config():
    config = mixtral((32, 4096, 32, 8, 14336), mesh=dict(data=-1, stage=4, tensor=2, expert=4))
    config.model.moe.update(dict(capacity_factor=1.0, fold_tensor=True))
    config.pipeline.update(dict(repeats=8, schedule='interleaved'))
    return config
