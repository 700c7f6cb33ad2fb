"""The key table: every config key once, with its default, what values it takes, what it
means and whether a resumed run may change it.

It drives `defaults()` (config/resolve.py), the checks a key makes of itself (`check_values`;
checks across keys stay in config/checks.py), `--help`'s key list (run/cli.py) and the key
table of docs/cli.md (`markdown()`; tests/test_configs.py holds the page equal to it).
Adding a key is one row here, plus its cross-key check if it has one.

A row's `values` says what the key takes:
    'int>0' 'int>=0'            integers (bools refused)
    'num>0' 'num>=0'            numbers
    '[0,1)' '(0,1]'             numbers in that interval
    'bool' 'str' 'any'          True/False, a string, anything (a cross-key check looks)
    ('a', 'b', ...)             one of these
Its `resume` says what a run continued from its workdir may do with it:
    'free'      change it (layouts, cadences, lengths, drills)
    'explicit'  change it only when asked to (the data stream: a deliberate new blend)
    'never'     keep it (what the parameters and the token ids mean)
The model's buffers, its state outside the gradient (a router's bias, FP8's amax history:
state['buffers'], model/buffers.py), resume as its parameters do: restored with them under any
layout, brought with them by `checkpoint.init_from`. A key that decides which buffers exist
or their shapes is 'never' (a checkpoint would not fit); a key that only sets how a rule moves
them (a rate) is 'free'.
"""

import dataclasses
import math


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key."""

    def __init__(self, key, message):
        super().__init__(f'config key {key}: {message}')
        self.key = key


@dataclasses.dataclass(frozen=True)
class Key:
    name: str
    default: object
    values: object
    doc: str
    resume: str = 'free'


ATTENTION_DOC = (
    'auto, fused, flash, plain: cuDNN flash attention, else the Pallas flash kernel (attention '
    'dropout, head dim up to 256), else einsums ([gpu.md](gpu.md#fused-attention))'
)
FAULT = 'fault drill (0: never); docs/faults.md'
KEYS = (
    Key('mesh.data', -1, 'any', 'data-parallel replicas; -1: the devices the others leave'),
    Key('mesh.stage', 1, 'any', 'pipeline stages; -1 as mesh.data'),
    Key(
        'mesh.expert',
        1,
        'any',
        'expert-parallel ranks: MoE experts split over them, more data parallelism for the '
        'rest (MoE models only); -1 as mesh.data',
    ),
    Key(
        'mesh.context',
        1,
        'any',
        'context-parallel ranks: each sequence in 2 x context chunks, rank r holding chunks r '
        'and 2 x context - 1 - r, keys and values gathered over them; -1 as mesh.data',
    ),
    Key('mesh.tensor', 1, 'any', 'tensor-parallel ranks; -1 as mesh.data'),
    Key('pipeline.repeats', 1, 'int>0', 'chunks per stage (v; > 1: interleaved)'),
    Key(
        'pipeline.schedule',
        '1f1b',
        ('1f1b', 'interleaved', 'gpipe', 'zbh1', 'zbv'),
        '1f1b (interleaved 1F1B when repeats > 1), interleaved (insists on repeats > 1), gpipe, '
        'zbh1 (ZB-H1: the backward split into input and weight gradients, the weights\' put off '
        'into the bubble; repeats 1), zbv (ZB-V: as zbh1 with two chunks a stage in a V, stage s '
        'holding chunks s and 2p - 1 - s, the loss on stage 0; repeats 2); checkpoints hold '
        'layer order, so a run resumes under any',
    ),
    Key(
        'pipeline.max_in_flight',
        0,
        'int>=0',
        'at most this many stage inputs held per stage (repeats 1), or micro-batches in the '
        'pipeline (repeats > 1, zbv: each holds up to v chunk inputs a stage; interleaved '
        'above p: this many times v chunk inputs a stage, a micro-batch entering while stage 0 '
        'holds fewer); 0: as the lockstep table needs (2 (p - s) - 1 with repeats 1, 2p '
        'micro-batches with zbv)',
    ),
    Key(
        'pipeline.steady_tick',
        False,
        'bool',
        "1f1b / interleaved / zbh1 / zbv: a tick's forward and backward layer work in one "
        'computation (one switch over the slot pairs the table holds) instead of a conditional '
        'each, so their collectives can hide under each other\'s matmuls; the same results',
    ),
    Key(
        'pipeline.fused_accumulation',
        False,
        'bool',
        '1f1b / interleaved: each kernel\'s weight gradient contracted in fp32 inside the add '
        'into its accumulator, which XLA:GPU fuses into the dW GEMM (no fp32 add pass a '
        'micro-batch); the same results to fp32 rounding',
    ),
    Key(
        'pipeline.overlap_grad_reduce',
        False,
        'bool',
        "1f1b / interleaved, the tick by slot: ZeRO-1's reduce-scatter of each chunk's block "
        'gradients inside the loop, a layer in each backward slot after the chunk\'s last '
        "(Megatron's --overlap-grad-reduce; what no slot takes, after the loop); the same "
        'results; no effect with one stage ([gpu.md](gpu.md#zero-1-inside-the-step))',
    ),
    Key(
        'pipeline.overlap_param_gather',
        False,
        'bool',
        "with pipeline.overlap_grad_reduce: ZeRO-1's all-gather of the blocks' compute copy "
        'in the engine, chunk by chunk, chunks 1.. beside the first ticks, which run only '
        "chunk 0 (Megatron's --overlap-param-gather); the same results "
        '([gpu.md](gpu.md#zero-1-inside-the-step))',
    ),
    Key(
        'pipeline.first_stage_layers',
        0,
        'int>=0',
        "layers on the first stage (0: the even share; Megatron's "
        '--decoder-first-pipeline-num-layers); the stages between share the rest evenly; no '
        'effect with one stage',
    ),
    Key(
        'pipeline.last_stage_layers',
        0,
        'int>=0',
        "layers on the last stage (0: the even share; Megatron's "
        '--decoder-last-pipeline-num-layers)',
    ),
    Key('model.num_layers', 12, 'int>0', 'decoder blocks', 'never'),
    Key('model.hidden', 768, 'int>0', 'width of the residual stream', 'never'),
    Key('model.heads', 12, 'int>0', 'attention heads', 'never'),
    Key(
        'model.ffn_hidden',
        0,
        'int>=0',
        'MLP width; 0: 4 x hidden (gelu), int(8/3 x hidden) rounded up to a multiple of '
        "model.ffn_multiple (swiglu, Llama's rule)",
        'never',
    ),
    Key('model.ffn_multiple', 256, 'int>0', "swiglu's ffn_hidden 0 rounds up to this", 'never'),
    Key('model.seq_len', 1024, 'int>0', 'tokens per sequence', 'explicit'),
    Key('model.vocab_size', 50257, 'int>0', "the tokenizer's vocabulary", 'never'),
    Key('model.init_std', 0.02, 'num>0', 'standard deviation of the initial weights', 'never'),
    Key('model.layer_norm_epsilon', 1e-5, 'num>0', 'epsilon of the norms (either kind)', 'never'),
    # The block ([models.md](models.md)): the defaults are GPT-3's; Llama's is position rope,
    # norm rmsnorm, mlp swiglu, kv_heads < heads, tie_embeddings and bias False.
    Key(
        'model.position',
        'learned',
        ('learned', 'rope'),
        'learned (a position table added to the embedding) or rope (queries and keys rotated; '
        '[models.md](models.md))',
        'never',
    ),
    Key('model.rope_theta', 10000.0, 'num>0', "rope's base (Llama 3: 500000)", 'never'),
    Key(
        'model.rope_scaling.type',
        'none',
        ('none', 'llama3'),
        "rope's frequency scaling: none or llama3 (Llama 3.1's)",
        'never',
    ),
    Key('model.rope_scaling.factor', 8.0, 'num>0', 'llama3: low frequencies / this', 'never'),
    Key('model.rope_scaling.low_freq_factor', 1.0, 'num>0', 'llama3: see models.md', 'never'),
    Key('model.rope_scaling.high_freq_factor', 4.0, 'num>0', 'llama3: see models.md', 'never'),
    Key(
        'model.rope_scaling.original_context',
        8192,
        'int>0',
        'llama3: the context the frequencies were trained for',
        'never',
    ),
    Key('model.norm', 'layernorm', ('layernorm', 'rmsnorm'), 'the norms of the blocks', 'never'),
    Key('model.mlp', 'gelu', ('gelu', 'swiglu'), 'the MLP of the blocks', 'never'),
    Key(
        'model.kv_heads',
        0,
        'int>=0',
        'key/value heads; 0: heads; fewer: grouped-query attention (dividing heads; mesh.tensor '
        'must divide it)',
        'never',
    ),
    Key('model.head_dim', 0, 'int>=0', 'width of a head; 0: hidden / heads', 'never'),
    Key('model.tie_embeddings', True, 'bool', 'False: a separate output layer', 'never'),
    Key(
        'model.qk_norm',
        False,
        'bool',
        "per-head RMSNorm of queries and keys before rope (Qwen3's)",
        'never',
    ),
    # A mixture of experts in place of the MLP ([models.md](models.md#mixture-of-experts)).
    Key(
        'model.moe.experts',
        0,
        'int>=0',
        'routed experts of each MoE block; 0: the dense MLP',
        'never',
    ),
    Key('model.moe.top_k', 2, 'int>0', 'experts each token is routed to', 'never'),
    Key(
        'model.moe.ffn_hidden',
        0,
        'int>=0',
        "each expert's MLP width (the block's MLP kind); 0: model.ffn_hidden",
        'never',
    ),
    Key('model.moe.shared_experts', 0, 'int>=0', 'always-on experts beside the routed', 'never'),
    Key(
        'model.moe.shared_ffn_hidden',
        0,
        'int>=0',
        "the shared experts' one MLP width; 0: shared_experts x moe.ffn_hidden",
        'never',
    ),
    Key(
        'model.moe.dense_layers',
        0,
        'int>=0',
        'the first layers keep the dense MLP of model.ffn_hidden (below num_layers; not with '
        "a dense model, GPipe's order with stages or delayed FP8)",
        'never',
    ),
    Key(
        'model.moe.router',
        'softmax',
        ('softmax', 'sigmoid'),
        "the router's scores: softmax (Mixtral, Qwen) or sigmoid (DeepSeek-V3), fp32",
        'never',
    ),
    Key('model.moe.norm_top_k', True, 'bool', "renormalise the k chosen experts' weights", 'never'),
    Key(
        'model.moe.routed_scale',
        1.0,
        'num>0',
        "the routed experts' weights times this (DeepSeek-V3's routed_scaling_factor, 2.5): "
        'renormalised top-k weights average the k outputs where a dense MLP sums its parts',
        'never',
    ),
    Key(
        'model.moe.aux_loss_coeff',
        0.01,
        'num>=0',
        "Switch's load-balancing loss per sequence, summed over layers (metric moe_aux_loss)",
    ),
    Key(
        'model.moe.bias_update_rate',
        0.0,
        'num>=0',
        "auxiliary-loss-free balancing: the router's per-expert choice bias moves by this x "
        'sign(mean load - load) after each step (0: never moves)',
    ),
    Key(
        'model.moe.fold_tensor',
        False,
        'bool',
        "parallel folding: in the MoE layers the tensor ranks are more expert ranks (experts "
        "whole, split over expert x tensor; tokens exchanged over both), no expert tensor "
        'all-reduce; checkpoints hold whole experts, so a run resumes either way',
    ),
    Key('model.moe.z_loss_coeff', 0.0, 'num>=0', "the router's z-loss (metric moe_z_loss)"),
    Key(
        'model.moe.exchange',
        'padded',
        ('padded', 'ragged'),
        "expert parallelism's token exchange: all_to_all of buffers of each expert's most rows "
        '(dropless: every row), or ragged_all_to_all of the chosen rows alone (the CPU runs '
        "its offsets through a padded all_to_all: XLA:CPU has none)",
    ),
    Key(
        'model.moe.capacity_factor',
        0.0,
        'num>=0',
        "0: dropless; > 0: an expert takes at most ceil(factor x seq_len x top_k / experts) "
        'of each sequence\'s choices, first choices first',
    ),
    Key('model.bias', True, 'bool', 'biases of the attention and MLP projections', 'never'),
    Key('model.attention_dropout', 0.1, '[0,1)', 'dropout of the attention probabilities'),
    Key('model.hidden_dropout', 0.1, '[0,1)', 'dropout of the residual branches'),
    Key(
        'model.compute_dtype',
        'bfloat16',
        ('float32', 'bfloat16', 'float16'),
        'dtype of the forward and backward (parameters and optimizer state stay fp32)',
    ),
    Key(
        'model.fp8',
        'none',
        ('none', 'tensorwise', 'delayed', 'blockwise'),
        "the block's matmuls in FP8 (needs bf16 or fp16 compute): tensorwise (each tensor's "
        "amax this step), delayed (an amax history, a buffer), blockwise (DeepSeek-V3's 1 x 128 "
        "tiles, 128 x 128 weight blocks); [models.md](models.md#fp8)",
        'never',
    ),
    Key(
        'model.fp8_amax_history',
        16,
        'int>0',
        "the delayed FP8 recipe's amax history: the steps whose largest amax scales a matmul "
        'operand (the buffer\'s length)',
        'never',
    ),
    Key(
        'model.fp8_margin',
        0,
        'int>=0',
        "FP8 scales map an operand's amax to the format's largest value / 2^margin",
    ),
    Key('model.remat', 'none', ('none', 'full', 'selective'), 'activation recompute'),
    Key(
        'model.remat_recompute',
        '',
        'str',
        "under remat selective, the kept matmul outputs the backward makes again instead, "
        "e.g. 'qkv,attn_out' (of qkv, context, attn_out, mlp_in, mlp_gate, mlp_up, mlp_out: "
        "SwiGLU's mlp_in is its gate and up; Megatron's --recompute-modules); docs/training.md",
    ),
    Key(
        'model.remat_offload',
        '',
        'str',
        "under remat selective, kept matmul outputs held in the host's memory from the "
        "forward to the backward instead of the GPU's, e.g. 'mlp_gate' (of those "
        'remat_recompute takes); docs/training.md',
    ),
    Key('model.attention', 'auto', ('auto', 'fused', 'flash', 'plain'), ATTENTION_DOC),
    Key(
        'model.sequence_parallel',
        False,
        'bool',
        "Megatron's sequence parallelism over tensor (needs seq_len divisible by it)",
    ),
    Key(
        'model.sequence_pieces',
        1,
        'int>0',
        "the block's matmuls run on this many pieces of each sequence, so that one piece's "
        'tensor-parallel collectives overlap the next piece\'s matmuls (1: whole sequences; '
        'the same results); must divide seq_len (seq_len / mesh.tensor under sequence '
        'parallelism)',
    ),
    Key(
        'model.loss_chunks',
        0,
        'int>=0',
        'output layer + loss over this many pieces of the sequence (model/loss.py); must '
        'divide seq_len; 0: the largest of 4, 3, 2, 1 that does',
    ),
    Key('train.global_batch', 512, 'int>0', 'sequences per step'),
    Key(
        'train.micro_batch',
        1,
        'int>0',
        'sequences per data-parallel replica per accumulated micro-step',
    ),
    Key('train.steps', 1000, 'int>0', 'steps of the whole run'),
    Key('train.seed', 0, 'int>=0', 'initial parameters, sample order and dropout', 'never'),
    Key('train.log_every', 10, 'int>0', 'steps between metrics records'),
    Key('train.eval_every', 500, 'int>=0', 'steps between validation runs (0: never)'),
    Key('train.eval_batches', 8, 'int>0', 'batches of a validation run'),
    Key(
        'train.rampup.start',
        0,
        'int>=0',
        'batch-size ramp-up: the first batch (0: no ramp-up)',
        'explicit',
    ),
    Key('train.rampup.increment', 0, 'int>=0', 'ramp-up: sequences added at a time', 'explicit'),
    Key('train.rampup.tokens', 0, 'int>=0', 'ramp-up: over the first this many tokens', 'explicit'),
    Key(
        'train.max_consecutive_skips',
        10,
        'int>0',
        'non-finite steps (skipped, state unchanged) in a row that stop the run',
    ),
    Key(
        'train.spike_factor',
        0.0,
        'num>=0',
        'loss-spike rollback (0: off): a loss above this x the mean of the last spike_window '
        'goes back to the newest checkpoint',
    ),
    Key('train.spike_window', 20, 'int>0', 'losses the spike rule averages'),
    Key('train.spike_skip_batches', 0, 'int>=0', 'batches skipped past a spike'),
    Key(
        'train.hang_timeout_s',
        0,
        'int>=0',
        'watchdog: seconds a batch, step, evaluation or save may take (0: 10 x the slowest '
        'of its kind, at least hang_floor_s)',
    ),
    Key('train.hang_floor_s', 300, 'int>0', "watchdog: the least allowance, in seconds"),
    Key(
        'train.profile_start',
        0,
        'int>=0',
        'a jax.profiler trace from this step into WORKDIR/profile (0: none); docs/training.md',
    ),
    Key('train.profile_steps', 3, 'int>0', 'steps the profile traces'),
    Key(
        'train.pgle_profile_steps',
        0,
        'int>=0',
        'XLA:GPU profile-guided scheduling: at each micro-step count the run reaches (its '
        'first, each ramp-up size) this many steps after the first traced, that count\'s step '
        'compiled again by their measured costs (0: off); launch/plan.py --target does it '
        'with the replay\'s costs; docs/gpu.md',
    ),
    Key(
        'train.xla_options',
        '',
        'str',
        'XLA options of this config\'s train step, `name=value` apart by spaces (XLA_FLAGS\' '
        'spelling, `--` optional), after the step\'s own; a one-line program compiled with '
        'them first refuses a name or value XLA does not take; docs/gpu.md',
    ),
    Key(
        'train.straggler_every',
        50,
        'int>=0',
        'steps between comparisons of the processes\' own speeds (0: never); docs/faults.md',
    ),
    Key(
        'train.straggler_ratio',
        1.5,
        'num>0',
        'a process slower than this x the median of the others is named (`straggler` line)',
    ),
    Key(
        'train.profile_all_processes',
        False,
        'bool',
        'every process traces its own (else process 0 alone)',
    ),
    Key('train.inject_nan_at_step', 0, 'int>=0', f'NaN loss and gradients from this step: {FAULT}'),
    Key('train.inject_nan_steps', 1, 'int>0', 'steps the NaN drill lasts'),
    Key('train.inject_spike_at_step', 0, 'int>=0', f'a 10 x loss at this step: {FAULT}'),
    Key(
        'train.inject_kill_at_step',
        0,
        'int>=0',
        f'at this step of a fresh run process inject_kill_process kills itself: {FAULT}',
    ),
    Key('train.inject_kill_process', 0, 'int>=0', 'the process the kill drill ends'),
    Key(
        'train.inject_hang_at_step',
        0,
        'int>=0',
        f'at this step process inject_hang_process stalls: {FAULT}',
    ),
    Key('train.inject_hang_process', 0, 'int>=0', 'the process the hang drill stalls'),
    Key('optimizer.lr', 6e-4, 'num>0', 'peak learning rate'),
    Key('optimizer.min_lr', 6e-5, 'num>=0', 'the cosine floor (at most lr)'),
    Key('optimizer.warmup_tokens', 0, 'num>=0', 'linear warm-up, in tokens'),
    Key(
        'optimizer.decay_tokens',
        0,
        'num>=0',
        'cosine decay to min_lr ends here, counted from the start (0: the whole run)',
    ),
    Key('optimizer.b1', 0.9, '[0,1)', "Adam's first-moment decay"),
    Key('optimizer.b2', 0.95, '[0,1)', "Adam's second-moment decay"),
    Key('optimizer.eps', 1e-8, 'num>0', "Adam's epsilon"),
    Key('optimizer.weight_decay', 0.1, 'num>=0', 'decoupled weight decay'),
    Key('optimizer.clip_norm', 1.0, 'num>=0', 'global gradient-norm clip (0: none)'),
    Key('checkpoint.every', 0, 'int>=0', 'steps between checkpoints (0: only at the end)'),
    Key('checkpoint.keep', 3, 'int>0', 'checkpoints kept'),
    Key(
        'checkpoint.init_from',
        '',
        'str',
        "a workdir or checkpoint whose newest parameters (and the model's buffers) start this "
        'run (under any layout); read while this workdir has no checkpoint of its own',
    ),
    Key(
        'checkpoint.init_full_state',
        False,
        'bool',
        'init_from brings the whole state and data position, not only the parameters',
    ),
    Key(
        'checkpoint.on_save_error',
        'stop',
        ('stop', 'continue'),
        'a failed save ends the run (exit 1), or warns and saves again at the next checkpoint',
    ),
    Key(
        'checkpoint.inject_save_error_at_step',
        0,
        'int>=0',
        f'the save of this step fails as on a full disk: {FAULT}',
    ),
    Key(
        'checkpoint.inject_save_error_process',
        -1,
        'int>=-1',
        'the process whose write the save drill fails; -1: every process',
    ),
    Key(
        'data.sources',
        ((0.5, 'data/default/kjv'), (0.5, 'data/default/python_stdlib')),
        'any',
        '`((weight, prefix), ...)` of `.bin`/`.idx` pairs, blended by weight',
        'explicit',
    ),
    Key(
        'data.split',
        '969,30,1',
        'any',
        "train, valid, test shares of each source's documents (Megatron's --split)",
        'explicit',
    ),
    Key(
        'data.tokenizer',
        'data/default/tokenizer.model',
        'str',
        'sentencepiece `.model`, GPT-2 BPE files (a folder with vocab.json and merges.txt), or '
        "a Hugging Face tokenizer.json (Llama 3's; the file or its folder); checked against "
        "model.vocab_size before training; '' for none",
        'never',
    ),
    Key(
        'data.order',
        'layout_independent',
        ('layout_independent', 'megatron'),
        "sample order: layout_independent, or megatron (Megatron-LM's own, to continue or "
        'compare its runs)',
        'explicit',
    ),
    Key(
        'data.reset_position_ids',
        False,
        'bool',
        "positions restart after each end-of-document token (Megatron's --reset-position-ids; "
        '[packed documents](data.md#packed-documents))',
        'explicit',
    ),
    Key(
        'data.reset_attention_mask',
        False,
        'bool',
        "a token attends only within its own document (Megatron's --reset-attention-mask)",
        'explicit',
    ),
    Key(
        'data.eod_mask_loss',
        False,
        'bool',
        "predictions made from an end-of-document token are left out of the loss (Megatron's "
        '--eod-mask-loss)',
        'explicit',
    ),
    Key(
        'data.eod_id',
        -1,
        'int>=-1',
        "the end-of-document id the three keys above cut at; -1: the tokenizer's",
        'never',
    ),
    Key(
        'distributed.heartbeat_timeout_s',
        30,
        'int>0',
        'several processes: one silent this long ends them all',
    ),
    Key(
        'distributed.initialization_timeout_s',
        300,
        'int>0',
        'how long the other processes wait for process 0 to start',
    ),
)
BY_NAME = {key.name: key for key in KEYS}
# The device mesh's axes, outermost first: the mesh.* rows in their order. Placed by the bytes
# each moves (parallel/mesh.py lays them over the nodes; parallel/rules.py maps logical names
# onto them); kept here, where the command line reads them before JAX is imported.
MESH_AXES = tuple(key.name.partition('.')[2] for key in KEYS if key.name.startswith('mesh.'))


def mesh_devices(mesh):
    """The devices a config's mesh section covers: its axes' sizes multiplied, a size that is
    not a positive integer (-1, to be filled) counted as 1."""
    sizes = (mesh[axis] for axis in MESH_AXES)
    return math.prod(s if isinstance(s, int) and s > 0 else 1 for s in sizes)


def choices(name):
    """The values a key with a fixed set takes, in the table's order."""
    return BY_NAME[name].values


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_RULES = {
    'int>0': (lambda v: _is_int(v) and v > 0, 'must be a positive integer'),
    'int>=0': (lambda v: _is_int(v) and v >= 0, 'must be an integer >= 0'),
    'int>=-1': (lambda v: _is_int(v) and v >= -1, 'must be -1 or an integer >= 0'),
    'num>0': (lambda v: _is_number(v) and v > 0, 'must be positive'),
    'num>=0': (lambda v: _is_number(v) and v >= 0, 'must be >= 0'),
    '[0,1)': (lambda v: _is_number(v) and 0 <= v < 1, 'must be in [0, 1)'),
    '(0,1]': (lambda v: _is_number(v) and 0 < v <= 1, 'must be in (0, 1]'),
    'bool': (lambda v: isinstance(v, bool), 'must be True or False'),
    'str': (lambda v: isinstance(v, str), 'must be a string'),
    'any': (lambda v: True, ''),
}


def check_value(key, value):
    """ConfigError naming the key unless `value` is one the key takes."""
    if isinstance(key.values, tuple):
        if value not in key.values:
            raise ConfigError(key.name, f'{value!r} is not one of {", ".join(key.values)}')
        return
    valid, message = _RULES[key.values]
    if not valid(value):
        raise ConfigError(key.name, f'{message}, got {value!r}')


def check_values(config, sections=None):
    """Every key of the table (of `sections`, if given) checked on its own."""
    for key in KEYS:
        if sections is None or key.name.split('.')[0] in sections:
            check_value(key, get(config, key.name))


def get(config, name):
    value = config
    for part in name.split('.'):
        value = value[part]
    return value


def nested_defaults():
    """{section: {key: default, sub: {...}}} of the whole table."""
    tree = {}
    for key in KEYS:
        *path, leaf = key.name.split('.')
        node = tree
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = key.default
    return tree


def _cell(value):
    if isinstance(value, tuple) and value and isinstance(value[0], tuple):
        return 'the default corpus'
    if isinstance(value, float) and value and (abs(value) < 1e-3 or math.log10(abs(value)) > 6):
        return f'{value:g}'
    return "''" if value == '' else str(value)


def _values_cell(values):
    if isinstance(values, tuple):
        return ', '.join(values)
    return {'any': '', 'str': 'a string', 'bool': 'true, false'}.get(values, values)


def markdown():
    """docs/cli.md's key table."""
    rows = ['| key | default | values | resume | meaning |', '|---|---|---|---|---|']
    for key in KEYS:
        rows.append(
            f'| `{key.name}` | {_cell(key.default)} | {_values_cell(key.values)} | '
            f'{key.resume} | {key.doc} |'
        )
    return '\n'.join(rows)
