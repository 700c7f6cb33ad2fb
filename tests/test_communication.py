"""Megatron's communication, read from the compiled step (plan/hlo.py's inventory): gradients
stay local over 'data' until the step ends, then one fp32 reduce-scatter and one compute-dtype
all-gather over 'data'; sequence parallelism turns each tensor all-reduce of a layer into a
reduce-scatter plus an all-gather. And bf16 gradients are summed in fp32, pipelined or not."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import support
from mtnlg_jax import config as config_lib
from mtnlg_jax.parallel import footprint
from mtnlg_jax.data import loader as loader_lib
from mtnlg_jax.plan import arithmetic, comm, report
from mtnlg_jax.plan import compile as compile_lib
from mtnlg_jax.plan import hlo, hlo_module
from mtnlg_jax.train.step import make_train_step

LAYOUTS = {  # sequence parallel on; vocabulary 1500 pads to 1536 on tensor 4 and 2 alike
    'plain': dict(data=2, tensor=4, vocab_size=1500),
    'pipelined': dict(data=2, stage=2, tensor=2, repeats=2, num_layers=4, vocab_size=1500),
}


@pytest.fixture(scope='module', params=list(LAYOUTS))
def train_step(request):
    config = support.small_config(remat='none', sequence_parallel=True, **LAYOUTS[request.param])
    compiled, _, info = compile_lib.compile_train_step(config)
    return config, hlo.collective_inventory(compiled.as_text(), info['mesh']), info


def test_data_parallel_traffic_is_one_reduce_scatter_and_one_all_gather(train_step):
    """Nothing over 'data' inside any loop (micro-steps, layers, pipeline iterations); per
    step, bytes sent over 'data' = one fp32 reduce-scatter of the gradients + one all-gather of
    the compute copy (fp32 here), each (d - 1) / d of the parameters a device computes with;
    what every pipeline stage holds over 'data' and 'stage' together, (d p - 1) / (d p) of it,
    and nothing else over 'stage' beyond scalars (the stages' shares of its gradients summed
    by that reduce-scatter, not by an all-reduce of their own)."""
    config, inventory, info = train_step
    over_data = [e for e in inventory if 'data' in e['axes']]
    assert not [e for e in over_data if e['in_loop']], 'a collective over data inside a loop'
    data, stages = config.mesh.data, config.mesh.stage
    joint = ('data', 'stage') if stages > 1 else ('data',)
    # Beyond these, only scalars (loss and token count summed over data and stage).
    assert all(e['axes'] in {('data',), joint} or e['bytes'] <= 64 for e in over_data)
    summed = [e for e in inventory if e['kind'] == 'all-reduce' and e['bytes'] > 64]
    assert not [e for e in summed if 'stage' in e['axes']]
    params = footprint.bytes_per_device(config, info['setup'])['parameters']  # fp32 compute copy
    shared = 4 * arithmetic.local_shared_params(config) if stages > 1 else 0
    both = data * stages
    one_pass = (data - 1) / data * (params - shared) + (both - 1) / both * shared

    def sent(kind):
        return sum(e['wire_bytes'] * e['count'] for e in over_data if e['kind'] == kind)

    assert sent('reduce-scatter') == pytest.approx(one_pass, rel=0.01)
    assert sent('all-gather') == pytest.approx(one_pass, rel=0.01)
    total = sum(e['wire_bytes'] * e['count'] for e in over_data)
    assert total <= 1.05 * 2 * one_pass


def _activation_bytes(config):
    return config.train.micro_batch * config.model.seq_len * config.model.hidden * 4  # fp32


def test_sequence_parallel_layer_gathers_and_scatters_over_tensor():
    """Per layer forward (the eval step's layer loop): 2 all-gathers of the activation from
    its sequence shards (before QKV and MLP-in) and 2 row-parallel sums of which each device
    keeps only its sequence shard: a reduce-scatter on GPUs; XLA:CPU has no pass fusing the
    all-reduce with the slice after it, so there the kept result is checked to be 1/t."""
    config = support.small_config(data=2, tensor=4, remat='none', sequence_parallel=True)
    compiled, _, info = compile_lib.compile_eval_step(config)
    text = compiled.as_text()
    inventory = hlo.collective_inventory(text, info['mesh'])
    layer_runs = config.train.micro_steps * config.model.num_layers
    in_layers = [e for e in inventory if e['count'] == layer_runs and e['axes'] == ('tensor',)]
    activation = _activation_bytes(config)
    gathers = [e for e in in_layers if e['kind'] == 'all-gather']
    sums = [e for e in in_layers if e['kind'] in ('all-reduce', 'reduce-scatter')]
    assert len(gathers) == 2 and len(sums) == 2 and len(in_layers) == 4
    assert all(e['bytes'] == activation for e in in_layers)
    computations, _ = hlo_module.parse_module(text)
    shard = activation // config.mesh.tensor
    for e in sums:
        if e['kind'] == 'all-reduce':  # every use of the sum keeps one sequence shard
            users = [
                i
                for i in computations[e['computation']]
                if re.search(rf'%{re.escape(e["name"])}\b', i.rest)
            ]
            assert users and all(hlo_module.shape_bytes(i.type_text) == shard for i in users)


def test_sequence_parallel_backward_gathers_each_row_parallel_gradient_once():
    """The train step's layer loop, Llama's block on two sequence pieces: per piece 2
    all-gathers over tensor forward (before QKV and MLP-in) and 2 backward, one per
    row-parallel product's output gradient, which both its transposed matmuls read
    (layers.onto_residual; left to the partitioner, one of them was gathered twice here, and
    on XLA:GPU a quarter of the 405 B's tensor all-gathers were such repeats)."""
    config = support.small_config(
        data=2, tensor=4, remat='none', sequence_parallel=True, sequence_pieces=2,
        **support.LLAMA_BLOCK,
    )  # fmt: skip
    compiled, _, info = compile_lib.compile_train_step(config)
    inventory = hlo.collective_inventory(compiled.as_text(), info['mesh'])
    layer_runs = config.train.micro_steps * config.model.num_layers
    gathers = [
        e
        for e in inventory
        if e['kind'] == 'all-gather' and e['axes'] == ('tensor',) and e['count'] == layer_runs
    ]
    piece = _activation_bytes(config) // 2  # one of the two pieces
    assert len(gathers) == 2 * (2 + 2)
    assert all(e['bytes'] == piece for e in gathers)


def test_the_gradient_is_gathered_once_on_pieces_unless_fp8_gathers_it_quantized():
    """layers.gathers_once: on sequence pieces, but not under tensorwise or delayed FP8,
    whose row-parallel products gather their gradient themselves in e5m2 (a bf16 gather
    ahead of them would double the bytes); blockwise FP8 gathers nothing itself."""
    from mtnlg_jax.model import layers

    def once(**model):
        return layers.gathers_once(support.small_config(compute_dtype='bfloat16', **model).model)

    assert not once() and once(sequence_pieces=2)
    assert once(sequence_pieces=2, fp8='blockwise')
    assert not once(sequence_pieces=2, fp8='tensorwise')
    assert not once(sequence_pieces=2, fp8='delayed')


def test_selective_recompute_gathers_the_layer_inputs_again_as_planned():
    """Under sequence parallelism selective recompute keeps the layer inputs' sequence shards,
    so the backward all-gathers the attention's and the MLP's inputs again: the compiled train
    step sends over tensor what keeping them whole (remat none) does plus half its layers'
    gathers, as plan/comm.py counts (6 all-gathers a layer instead of 4)."""
    sent, planned = {}, {}
    for remat in ('none', 'selective'):
        config = support.small_config(data=2, tensor=4, remat=remat, sequence_parallel=True)
        compiled, _, info = compile_lib.compile_train_step(config)
        inventory = hlo.collective_inventory(compiled.as_text(), info['mesh'])
        sent[remat] = report.compiled_comm(inventory)['all-gather']['tensor']
        planned[remat] = comm.comm_bytes_per_device(config)['all-gather']['tensor']
    layer_runs = config.train.micro_steps * config.model.num_layers
    gather = _activation_bytes(config) * 3 / 4  # a ring all-gather over 4
    assert planned['selective'] - planned['none'] == 2 * layer_runs * gather
    assert sent['selective'] - sent['none'] == pytest.approx(2 * layer_runs * gather, rel=0.01)


def test_the_embedding_and_head_tables_cross_the_replicas_once_together():
    """Untied tables on a pipeline: the embedding's gradient is stage 0's alone and the head's
    the last stage's, so one fp32 reduce-scatter over 'data' carries both in one table's
    bytes, and one over 'stage' of 2 / d of a table lands each on its ZeRO shard
    (zero._owned_pair), as the plan counts. Neither crosses data x stage whole, the other
    stages' zeros included: on the Llama 3 405B that was the last 2.1 GB a GPU after the
    loop."""
    config = support.small_config(
        data=2, stage=2, tensor=2, repeats=2, num_layers=4, remat='none', **support.LLAMA_BLOCK
    )
    compiled, _, info = compile_lib.compile_train_step(config)
    inventory = hlo.collective_inventory(compiled.as_text(), info['mesh'])
    vocab, hidden = compile_lib.abstract_state(info['setup'])['params']['output_embed'].shape
    table = 4 * vocab // config.mesh.tensor * hidden  # a device's fp32 gradient of one table
    scatters = [e for e in inventory if e['kind'] == 'reduce-scatter']
    assert not [e for e in scatters if e['axes'] == ('data', 'stage') and e['bytes'] >= table]
    over_data = [e for e in scatters if e['axes'] == ('data',) and e['bytes'] == table]
    over_stage = [e for e in scatters if e['axes'] == ('stage',)]
    assert len(over_data) == 1 and not over_data[0]['in_loop']
    assert [e['bytes'] for e in over_stage] == [2 * table // config.mesh.data]
    planned = comm.comm_bytes_per_device(config)['reduce-scatter']  # as plan/comm.py counts
    compiled = report.compiled_comm(inventory)['reduce-scatter']
    assert {k: planned[k] for k in compiled} == pytest.approx(compiled)


def test_compute_copy_is_gathered_in_the_compute_dtype():
    """The program (before XLA:CPU widens bf16 collectives to fp32 for its runtime) gathers
    bf16 parameters over 'data' and reduce-scatters fp32 gradients."""
    config = support.small_config(data=4, tensor=2, compute_dtype='bfloat16')
    mesh, setup = compile_lib.layout(config)
    batch = loader_lib.abstract_train_batch(config, mesh, config.train.micro_steps)
    state = compile_lib.abstract_state(setup)
    with jax.set_mesh(mesh):
        text = make_train_step(config, setup).lower(state, *batch, jnp.float32(1)).as_text()
    gathered, scattered = (_result_dtypes(text, f'"stablehlo.{op}"') for op in OPS)
    assert gathered and set(gathered) == {'bf16'}
    assert scattered and set(scattered) == {'f32'}


OPS = ('all_gather', 'reduce_scatter')


def _result_dtypes(text, op):
    """Element types of the results of each `op` in StableHLO text (a reduce_scatter's type
    follows its reduction region, lines later)."""
    pieces = text.split(op)[1:]
    return [re.search(r'-> tensor<[^>]*x(\w+)>', piece).group(1) for piece in pieces]


def _bf16_config(stage, compute_dtype):
    """4 layers, 32 micro-batches of one sequence, on `stage` pipeline stages."""
    config = support.small_config(stage=stage, num_layers=4, compute_dtype=compute_dtype)
    config.train.update(dict(global_batch=32, micro_batch=1))
    return config_lib.resolve(config, stage)


def test_bf16_pipelined_gradients_are_summed_in_fp32():
    """m = 32: a bf16 step's gradient error against fp32 is no worse pipelined than not."""
    batch = support.random_batches(2).reshape(32, -1)
    _, _, reference = support.gradients(_bf16_config(1, 'float32'), batch)

    def error(stage):
        _, _, grads = support.gradients(_bf16_config(stage, 'bfloat16'), batch)
        pairs = zip(jax.tree.leaves(grads), jax.tree.leaves(reference))
        squared_error = sum(((np.asarray(g) - r) ** 2).sum() for g, r in pairs)
        return np.sqrt(squared_error / sum((r**2).sum() for r in jax.tree.leaves(reference)))

    unpipelined, pipelined = error(1), error(2)
    assert 0 < unpipelined < 0.05
    assert pipelined <= 1.1 * unpipelined, (pipelined, unpipelined)


def test_a_bf16_gpipe_step_runs_on_a_cpu_mesh_and_equals_one_devices():
    """GPipe in bf16, Llama blocks, 2 stages: XLA:CPU aborts on a bf16 all-reduce inside the
    engine's shard_map, so on a CPU mesh the input's cotangent and the outputs cross `stage`
    in fp32 (gpipe.summed_dtype). Loss and every gradient leaf as one device's bf16 step
    within bf16's noise (both about 0.5 % of each leaf's largest entry, as 1F1B's)."""
    batch = support.random_batches(1)[0]

    def run(**layout):
        config = support.small_config(**support.LLAMA_BLOCK, compute_dtype='bfloat16', **layout)
        return support.gradients(config, batch)[1:]

    (loss, grads), (one_loss, one_grads) = run(stage=2, schedule='gpipe'), run()
    assert loss == pytest.approx(one_loss, rel=1e-3)
    support.assert_within_leaf_scale(grads, one_grads, 0.015, what='gradient')
