"""The planner's arithmetic against the MT-NLG and Megatron papers' own figures, and its
communication formulas against hand counts. No compile: shapes only."""

import dataclasses
import pathlib

import pytest

import support
from mtnlg_jax import config as config_lib
from mtnlg_jax.plan import arithmetic, clusters, comm, predict, printout, report

ROOT = pathlib.Path(__file__).resolve().parents[1]


def mtnlg(data=8, stage=35, tensor=8, global_batch=1920, schedule='1f1b'):
    """configs/mtnlg_530b.py with the paper's recipe (full recompute, 1F1B), whose arithmetic
    these tests reproduce."""
    config = config_lib.load(str(ROOT / 'configs/mtnlg_530b.py'))
    config.model.remat = 'full'
    config.pipeline.update(dict(repeats=1, max_in_flight=0))
    config.pipeline.schedule = schedule
    config.mesh.update(dict(data=data, stage=stage, tensor=tensor))
    config.train.global_batch = global_batch
    config.train.rampup.start = 0
    return config_lib.resolve(config, data * stage * tensor)


@pytest.fixture(scope='module')
def unsplit_530b():
    return mtnlg(data=1, stage=1, tensor=1, global_batch=32)


def test_530b_has_529_6_billion_parameters_counted_from_its_shapes(unsplit_530b):
    params = arithmetic.param_count(unsplit_530b.model)
    assert round(params / 1e9, 1) == 529.6
    assert arithmetic.local_param_counts(unsplit_530b) == (params, params)  # the real tree


def test_mixed_precision_adam_takes_20_bytes_a_parameter_over_10_tb(unsplit_530b):
    """bf16 weights 2 + bf16 gradients 2 + fp32 gradients 4 + fp32 master 4 + Adam 4 + 4."""
    state = arithmetic.state_bytes(unsplit_530b)
    params = arithmetic.param_count(unsplit_530b.model)
    total = state['params'] + state['grads'] + state['optimizer']
    assert total == 20 * params
    assert total > 10e12


def test_zero_1_with_fp32_accumulation_takes_8_plus_12_over_d_bytes_a_parameter():
    """Compute copy, its gradients and the fp32 accumulators whole on every replica (summed
    locally until one reduce-scatter per step), the fp32 master and moments split over d."""
    config = support.small_config(data=4, hidden=64, compute_dtype='bfloat16')
    compute, zero = arithmetic.local_param_counts(config)
    state = arithmetic.state_bytes(config)
    assert compute == arithmetic.param_count(config.model)
    assert zero * 4 == pytest.approx(compute, rel=0.01)  # all but a few tiny leaves divide
    per_param = (state['params'] + state['grads'] + state['optimizer']) / compute
    assert per_param == pytest.approx(2 + 2 + 4 + 12 / 4, rel=0.01)


def test_boundary_activations_of_the_paper():
    """1920 x 105 x 2048 x 20480 x 2 bytes = 16.9 TB for the whole batch; 8.8 GB for one
    micro-batch of one sequence (gradient accumulation over 1920)."""
    model = mtnlg().model
    assert round(arithmetic.boundary_activation_bytes(model, 1920) / 1e12, 1) == 16.9
    assert round(arithmetic.boundary_activation_bytes(model, 1) / 1e9, 1) == 8.8


def test_naming_the_context_frees_nothing_where_a_fused_kernel_keeps_it():
    """model.remat_recompute='context' under selective recompute: plain attention's context
    (Llama 3 405B's, bf16[8192, 16, 128] a layer: 0.25 GiB a chunk input of 2 layers) is not
    kept; cuDNN on an H100 keeps its output whatever the name says (the plan counted 5 GiB
    less for it, at no time, so a search over the names would have taken it)."""

    def activations(names, cluster):
        config = config_lib.load(str(ROOT / 'configs/llama3_405b.py'))
        config.model.remat_recompute = names
        config = config_lib.resolve(config, 8192)
        return report.memory(config, cluster)[0]['activations']

    h100 = clusters.CLUSTERS['h100-80gb']
    assert activations('context', h100) == activations('', h100)
    assert activations('context', None) < activations('', None)


def test_the_plan_counts_megatron_flops_with_the_configs_recompute():
    """The plan's hardware FLOPs are Megatron's formula with recompute when model.remat is
    full (96: the paper's 125.7 TFLOP/s per GPU at 60.1 s on 2240 GPUs; the three-row table
    is test_configs.py's), without it otherwise (72)."""
    config = mtnlg()
    flops = report.make_plan(config)['hardware_flops_per_step']
    assert round(flops / 2240 / 60.1 / 1e12, 1) == 125.7
    config.model.remat = 'none'
    assert report.make_plan(config)['hardware_flops_per_step'] == pytest.approx(flops * 72 / 96)


def test_the_paper_run_sits_above_the_lower_bound_on_its_cluster():
    """On 2240 A100s the paper's 60.1 s iteration is slower than the bound (compute at peak +
    exposed communication + bubble), and its 126 TFLOP/s under the bound's ceiling; the
    layout fits 80 GB with the 1F1B engine (stash bounded by the table), not in GPipe order
    (every iteration's stage input kept)."""
    plan = report.make_plan(mtnlg(), 'a100-80gb')
    estimate = plan['cluster']
    assert estimate['devices'] == 2240 and estimate['nodes'] == 280
    assert estimate['compute_s'] < estimate['iteration_s_lower_bound'] < 60.1
    assert estimate['tflops_per_gpu_upper_bound'] > 126
    assert estimate['bubble_s'] == pytest.approx(estimate['compute_s'] * 34 / 240)
    assert estimate['fits']
    assert not report.make_plan(mtnlg(schedule='gpipe'), 'a100-80gb')['cluster']['fits']
    faster = report.make_plan(mtnlg(), 'h100-80gb')['cluster']
    assert faster['iteration_s_lower_bound'] < estimate['iteration_s_lower_bound']


def test_communication_formulas_by_hand():
    """data 2 x tensor 4, 2 micro-steps of b = 4 sequences, 2 layers, fp32 (e = 4 bytes):
    tensor: (2 x 2 layers + 2 embedding/head) all-reduces per micro-step x 2 micro-steps,
    each 2 (t-1)/t b s h e; data: (d-1)/d of the fp32 gradients and of the compute copy."""
    config = support.small_config(data=2, tensor=4, remat='none', hidden=64)
    activation = 4 * support.SEQ_LEN * 64 * 4
    planned = comm.comm_bytes_per_device(config)
    tensor_runs = 2 * (4 * 2 + 2)
    assert planned['all-reduce']['tensor'] == pytest.approx(tensor_runs * 2 * 3 / 4 * activation)
    compute, _ = arithmetic.local_param_counts(config)
    assert planned['reduce-scatter']['data'] == pytest.approx(0.5 * 4 * compute)
    assert planned['all-gather']['data'] == pytest.approx(0.5 * 4 * compute)
    assert set(planned) == {'all-reduce', 'reduce-scatter', 'all-gather'}


def test_gpipe_hand_offs_and_recompute_by_hand():
    """GPipe order, stage 2 x repeats 2 x 4 micro-batches: 2 x 4 + 2 - 1 = 9 iterations, one
    (b, s, h) hand-off each way per iteration; full recompute per chunk of 1 layer: 2 forward +
    (2 - 1) recomputed + 2 backward all-reduces per iteration."""
    config = support.small_config(
        data=1, stage=2, tensor=2, repeats=2, num_layers=4, micro_steps=4, remat='full',
        schedule='gpipe',
    )  # fmt: skip
    activation = 4 * support.SEQ_LEN * 64 * 4  # b = 16 / 4 micro-steps
    planned = comm.comm_bytes_per_device(config)
    assert planned['collective-permute']['stage'] == 2 * 9 * activation
    # per pass through the stage's 2 layers (2 chunks): 4 + 4 + (4 - 2)
    assert comm.tensor_allreduces_per_micro_batch(config) == 10
    edge = 2 * 4 / 2  # embedding and head: 4 micro-batches split over 2 stages
    assert planned['all-reduce']['tensor'] == pytest.approx((9 * 5 + edge) * 2 * 1 / 2 * activation)


def test_1f1b_engine_hand_offs_and_recompute_by_hand():
    """The interleaved 1F1B table of stage 2 x repeats 2 x 4 micro-batches has 12 ticks, two
    hand-offs a tick split over tensor 2; per device (mean over stages) 8 chunk forwards of 2
    all-reduces (the last chunk's in its backward's tick), 8 backwards of 2 recomputed by
    remat full (less the dead one) + 2 backward, the embedding's 4 / 2 and the head's 4 / 2:
    no backward recomputes its chunk from its input any more."""
    config = support.small_config(
        data=1, stage=2, tensor=2, repeats=2, num_layers=4, micro_steps=4, remat='full'
    )
    activation = 4 * support.SEQ_LEN * 64 * 4
    planned = comm.comm_bytes_per_device(config)
    assert planned['collective-permute']['stage'] == 2 * 12 * activation / 2
    runs = 8 * 2 + 8 * (4 - 1) + 4 / 2 + 4 / 2
    assert planned['all-reduce']['tensor'] == pytest.approx(runs * activation)  # ring over 2


def test_every_cluster_has_the_figures_the_estimate_needs():
    assert {'a100-80gb', 'h100-80gb', 'h200-141gb'} <= set(clusters.CLUSTERS)
    for cluster in clusters.CLUSTERS.values():
        assert cluster.peak_tflops['bfloat16'] > 0 and cluster.hbm_bytes in (80e9, 141e9)
        assert cluster.nvlink_bandwidth > cluster.internode_bandwidth > 0


def tiny_moe(**mesh):
    """configs/tiny_moe.py resolved on its own layout; `mesh` then set on the resolved config
    (the planner's arithmetic reads the axes; no devices are made)."""
    config = config_lib.resolve(config_lib.load(str(ROOT / 'configs/tiny_moe.py')), 8)
    config.mesh.update(mesh)
    return config


def test_moe_model_flops_count_the_active_parameters_by_hand():
    """tiny_moe: 4 layers, hidden 256, 8 query heads over 2 key/value heads of 32, a shared
    SwiGLU expert 528 wide and 8 routed 88 wide, top 2, untied vocabulary 8192, RMSNorm, no
    biases."""
    config = tiny_moe()
    h, layers, vocab, seq = 256, 4, 8192, 128
    attention = 2 * h * 8 * 32 + 2 * h * 2 * 32
    expert, shared = 3 * h * 88, 3 * h * 528
    outside = 2 * vocab * h + h  # embedding, output layer, final norm
    per_layer = attention + h * 8 + 2 * h + shared  # + router + 2 norms + the shared expert
    total = outside + layers * (per_layer + 8 * expert)
    active = outside + layers * (per_layer + 2 * expert)
    plan = report.make_plan(config)
    assert plan['params'] == total == 8_644_864
    assert plan['moe']['active_params'] == active == 7_022_848
    assert plan['moe']['routed_expert_params'] == layers * 8 * expert
    tokens = config.train.global_batch * seq
    assert plan['model_flops_per_step'] == (6 * active + 12 * layers * h * seq) * tokens
    # Megatron's hardware count: the active matmul weights, recompute included (remat full)
    matmuls = layers * (attention + h * 8 + shared + 2 * expert)
    hardware = 96 * tokens * (matmuls / 12 + layers * seq * h / 6 + h * vocab / 16)
    assert plan['hardware_flops_per_step'] == pytest.approx(hardware)


def test_expert_ranks_divide_the_expert_weights_and_nothing_else():
    one, two = tiny_moe(), tiny_moe(expert=2)
    experts_one, experts_two = arithmetic.expert_bytes(one), arithmetic.expert_bytes(two)
    # split over stage 2 and tensor 2 already, over expert 2 too: halved
    assert experts_two['params'] * 2 == experts_one['params'] > 0
    assert experts_one['params'] == 4 * 8 * 3 * 256 * 88 * 4 / 4  # fp32, / (stage x tensor)
    rest = [arithmetic.local_param_counts(c, routed_experts=False) for c in (one, two)]
    assert rest[0][0] == rest[1][0]  # the compute copy: whole on every expert rank
    assert rest[0][1] == 2 * rest[1][1]  # ZeRO-1's shard: over data x expert, the replicas
    assert arithmetic.local_param_counts(two)[0] == rest[1][0] + experts_two['params'] / 4


def test_the_plan_says_it_does_not_count_the_batched_paths_weight_copies():
    """One expert rank split over tensor unfolded (tiny_moe's tensor 2): the printout does not
    say it fits, and notes why; folded, or over two expert ranks, it says fits."""
    for fold, expert, uncounted in ((False, 1, True), (True, 1, False), (False, 2, False)):
        config = tiny_moe(expert=expert)
        config.model.moe.fold_tensor = fold
        printed = printout.lines(report.make_plan(config, 'h100-80gb'))
        fits = next(line for line in printed if line.startswith('  fits'))
        noted = [line for line in printed if line.startswith('  note') and 'batched' in line]
        word = 'not known (note above)' if uncounted else 'yes'
        assert (fits.startswith(f'  fits       {word}:'), len(noted)) == (True, uncounted), fits


def test_all_to_all_over_expert_is_twice_a_layer_forward_and_twice_backward():
    """No pipeline, no recompute: m micro-batches x L layers x 4 all-to-alls of the exchange's
    buffers, 8 experts x b s rows of hidden h (dropless: every row of a rank; the b s k
    choices padded 8 / k), (x - 1) / x of them leaving the device."""
    config = tiny_moe(expert=4, stage=1)
    config.model.remat = 'none'
    config.pipeline.repeats = 1
    b, s, k, h, m = config.train.micro_batch, 128, 2, 256, config.train.micro_steps
    want = m * 4 * 4 * b * s * k * (8 / k) * h * 4 * 3 / 4
    assert comm.comm_bytes_per_device(config)['all-to-all'] == {'expert': want}
    assert 'all-to-all' not in comm.comm_bytes_per_device(tiny_moe())  # one expert rank
    config.model.remat = 'selective'  # the backward repeats the forward's two (measured)
    assert comm.comm_bytes_per_device(config)['all-to-all'] == {'expert': 1.5 * want}


def zero_by_hand(config):
    """{kind: {axes: bytes one device sends}} of ZeRO-1 in tiny_moe at data 2 x stage 2 x
    expert 2 x tensor 2: the routed experts' gradients reduce-scattered over 'data' (2 ranks),
    the rest of the block stack's over data x expert (4), the final norm's over stage x data
    x expert (8, each stage's share summed on the way), and the two untied tables', stage 0's
    and stage 1's alone, in one table's bytes over data x expert, then 2 / 4 of one over
    'stage' (zero._owned_pair); fp32 in, the compute copy gathered back in its dtype, the
    tables' over stage x data x expert."""
    e = arithmetic.itemsize(config.model.compute_dtype)
    experts = arithmetic.local_param_counts(config, routed_experts=True)[0]
    compute = arithmetic.local_param_counts(config)[0]
    joint = arithmetic.local_shared_params(config, joint=True)
    table = arithmetic.local_paired_table(config)
    assert experts and joint and compute - experts - joint and table
    groups = {'data': (experts, 2), 'data+expert': (compute - experts - joint, 4)}
    groups['data+stage+expert'] = (joint, 8)
    sent = {
        kind: {axes: size * count * (n - 1) / n for axes, (count, n) in groups.items()}
        for kind, size in (('reduce-scatter', 4), ('all-gather', e))
    }
    scatter = sent['reduce-scatter']
    scatter['data+expert'] += 4 * table * 3 / 4
    scatter['data+stage+expert'] -= 4 * 2 * table * 7 / 8
    scatter['stage'] = 4 * 2 * table / 4 * 1 / 2
    return sent


def test_zero_runs_over_each_parameters_replica_axes_data_and_expert():
    config = tiny_moe(expert=2)
    planned = comm.comm_bytes_per_device(config)
    for kind, per_axes in zero_by_hand(config).items():
        replicated = {axes for axes in planned[kind] if axes != 'tensor'}
        assert replicated == set(per_axes)
        assert {axes: planned[kind][axes] for axes in per_axes} == pytest.approx(per_axes)


def test_the_prediction_waits_for_zero_over_data_and_expert():
    """16 GPUs span two nodes: ZeRO's bytes cross the network at the H100's figures (link
    efficiency 1, nothing hidden by the documented rule)."""
    cluster = clusters.CLUSTERS['h100-80gb']
    config = tiny_moe(expert=2)
    sent = sum(
        size for per_axes in zero_by_hand(config).values() for axes, size in per_axes.items()
        if axes != 'stage'  # the tables' shards over 'stage' alone: the step's stage term
    )  # fmt: skip
    step = predict.step_time(config, cluster)
    assert step['data_comm_s'] == pytest.approx(sent / cluster.internode_bandwidth)


def test_the_exchange_pads_the_experts_rows_x_over_k_dropless_about_the_capacity_else():
    """tiny_moe: 8 experts, top 2, sequence 128. Dropless, each expert's buffer takes every
    row of every rank: 8 x b s rows for 2 b s choices. At capacity 1.25 an expert has
    ceil(1.25 x 128 x 2 / 8) = 40 slots a sequence: 8 x 40 rows for 256 choices."""
    assert arithmetic.expert_padding(tiny_moe()) == 1.0  # one expert rank: the choices only
    config = tiny_moe(expert=2)
    assert arithmetic.expert_padding(config) == 4.0
    config.model.moe.capacity_factor = 1.25
    assert arithmetic.expert_padding(config) == 8 * 40 / 256


def test_an_expert_layer_keeps_its_padded_rows_and_its_experts_outputs():
    """Selective recompute keeps the experts' gate and up projections (k x padding rows of
    the expert width, split over tensor) and their outputs (moe_out: k x padding rows of the
    hidden width, whole); folded, the two all-to-alls' deliveries (1/t of those rows each)
    and not the outputs, which no backward reads (Qwen3-235B-A22B's compile:
    docs/benchmarks.md)."""
    model = tiny_moe().model
    e, s, rows, t, k, h, f = 4, 128, 2, 2, 2, 256, 88
    for fold, routed in ((False, k * h), (True, 2 * k * h / t)):
        one, four = (
            arithmetic.layer_activation_bytes(model, rows, t, 'selective', padding=p, fold=fold)
            for p in (1, 4)
        )
        assert four - one == s * rows * e * 3 * (k * f * 2 / t + routed), fold


def test_the_prediction_charges_the_all_to_all_and_the_exchanges_padding():
    cluster = clusters.CLUSTERS['h100-80gb']
    one = predict.step_time(tiny_moe(), cluster)
    two = predict.step_time(tiny_moe(expert=2), cluster)
    assert one['expert_comm_s'] == 0.0 and two['expert_comm_s'] > 0.0
    assert (one['expert_padding'], two['expert_padding']) == (1.0, 4.0)
    assert two['compute_s'] > one['compute_s']  # every buffer's row multiplied
    # selective recompute exchanges again unless folded (the exchanged rows kept), as
    # plan/comm.py's all-to-all bytes count it: slower links cost the folded recompute nothing
    slow = dataclasses.replace(cluster, nvlink_bandwidth=cluster.nvlink_bandwidth / 10)
    selective = tiny_moe(expert=2, tensor=2)
    selective.model.update(remat='selective')
    for fold, grows in ((False, True), (True, False)):
        selective.model.moe.fold_tensor = fold
        fast, slower = (predict.step_time(selective, c)['recompute_s'] for c in (cluster, slow))
        assert (slower > fast) == grows and fast > 0.0, (fold, fast, slower)


def test_offloaded_names_leave_the_device_at_no_time():
    """model.remat_offload='mlp_in' frees on the device what remat_recompute='mlp_in' frees
    (SwiGLU's gate and up: the 405B's largest residuals), and makes nothing again."""

    def planned(**names):
        config = config_lib.load(str(ROOT / 'configs/llama3_405b.py'))
        config.model.update(dict(dict(remat_recompute='qkv', remat_offload=''), **names))
        config = config_lib.resolve(config, 8192)
        h100 = clusters.CLUSTERS['h100-80gb']
        made_again = predict.step_time(config, h100)['recompute_s']
        return report.memory(config, h100)[0]['activations'], made_again

    kept, made_again = planned()
    offloaded, offloaded_made_again = planned(remat_offload='mlp_in')
    recomputed, recomputed_made_again = planned(remat_recompute='qkv,mlp_in')
    assert offloaded == recomputed < kept
    assert offloaded_made_again == made_again < recomputed_made_again
    # the gate alone ('mlp_gate', as the config) frees half, the up kept
    gate, gate_made_again = planned(remat_offload='mlp_gate')
    assert kept - gate == pytest.approx((kept - offloaded) / 2, rel=1e-12)
    assert gate_made_again == made_again
