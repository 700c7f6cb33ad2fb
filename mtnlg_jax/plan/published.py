"""Published step times of Megatron-style GPT training on A100s, with the layout of each run:
what the step-time model (plan/predict.py) is fitted on and checked against.

Every figure is the paper's own; each row names its paper and table. All runs: DGX A100
80 GB nodes (8 GPUs, NVLink, 8 x 200 Gb/s HDR), sequence 2048, vocabulary 51,200, 16-bit
compute, micro-batch 1 unless said, Megatron's tensor parallelism inside a node.

    fit       Narayanan et al. 2021 (arXiv 2104.04473), table 1: ten GPT models, 1.7 B to
              1 T parameters, 32 to 3,072 GPUs, achieved TFLOP/s per GPU (their eq. 3, full
              recompute). Only these rows are fitted.
    held back Narayanan et al. 2021, table 2 (the PTD-P rows: 175 B and 530 B at three GPU
              counts each); Korthikanti et al. 2022 (arXiv 2205.05198), tables 3 and 5 (22 B to
              1 T, full recompute and sequence parallel + selective recompute, data parallel
              1) and section 6.3 (the 530 B at data parallel 8: 39.15 s); MT-NLG (Smith et al.
              2022, arXiv 2201.11990): 60.1 / 50.2 / 44.4 s per iteration on 280 / 350 / 420
              nodes, global batch 1920, the paper's table of iteration times.

What the papers do not say, and what we take (the `assumed` column of each row):
    * Narayanan tables 1 and 2 use the interleaved schedule (section 5.1) without saying
      with how many chunks: we take v = the smallest divisor above 1 of the layers per
      stage (3 for the 530 B, whose 3 layers a stage Korthikanti runs at v = 3).
    * Narayanan table 1 gives no micro-batch size: 1, as in its table 2 and sections 5.3-5.4.
    * Narayanan table 2's "model-parallel size" 96 of the 175 B is tensor 8 x pipeline 12.
    * Korthikanti's 1 T row: no interleaving (section 6 names it for the 175 B and 530 B only).
    * MT-NLG ran DeepSpeed's 1F1B pipeline (no interleaving), full recompute.
"""

import dataclasses

import ml_collections

NARAYANAN_T1 = 'Narayanan et al. 2021 (arXiv 2104.04473), table 1'
NARAYANAN_T2 = 'Narayanan et al. 2021 (arXiv 2104.04473), table 2'
KORTHIKANTI_T5 = 'Korthikanti et al. 2022 (arXiv 2205.05198), tables 3 and 5'
KORTHIKANTI_6_3 = 'Korthikanti et al. 2022 (arXiv 2205.05198), section 6.3'
MTNLG = 'Smith et al. 2022 (arXiv 2201.11990), MT-NLG iteration times'

# GPT shapes (heads, hidden, layers) of the models the rows train.
SHAPES = {
    '1.7B': (24, 2304, 24),
    '3.6B': (32, 3072, 30),
    '7.5B': (32, 4096, 36),
    '18.4B': (48, 6144, 40),
    '22B': (64, 6144, 48),
    '39.1B': (64, 8192, 48),
    '76.1B': (80, 10240, 60),
    '145.6B': (96, 12288, 80),
    '175B': (96, 12288, 96),
    '310.1B': (128, 16384, 96),
    '530B': (128, 20480, 105),
    '1T': (160, 25600, 128),
}


@dataclasses.dataclass(frozen=True)
class Row:
    """One published measurement and the layout that made it.

    Exactly one of `tflops` (achieved TFLOP/s per GPU by the paper's eq. 3, full recompute
    counted) or `seconds` (iteration time) is the published figure."""

    source: str
    model: str
    tensor: int
    stage: int
    gpus: int
    global_batch: int
    tflops: float = None
    seconds: float = None
    micro_batch: int = 1
    repeats: int = 1
    remat: str = 'full'  # full | selective (Korthikanti's, with sequence parallelism)
    sequence_parallel: bool = False
    fit: bool = False  # a row the efficiency figures are fitted on
    assumed: str = ''

    @property
    def data(self):
        return self.gpus // (self.tensor * self.stage)

    @property
    def name(self):
        recompute = 'SP + selective' if self.sequence_parallel else 'full recompute'
        return f'{self.model} t{self.tensor} p{self.stage} d{self.data} v{self.repeats} ' + (
            f'b{self.micro_batch} B{self.global_batch}, {recompute}'
        )


def _t1(model, tensor, stage, gpus, batch, tflops, repeats=1):
    assumed = 'micro-batch 1' + (f', v {repeats}' if stage > 1 else '')
    return Row(NARAYANAN_T1, model, tensor, stage, gpus, batch, tflops=tflops,
               repeats=repeats, fit=True, assumed=assumed)  # fmt: skip


TABLE_1 = (
    _t1('1.7B', 1, 1, 32, 512, 137),
    _t1('3.6B', 2, 1, 64, 512, 138),
    _t1('7.5B', 4, 1, 128, 512, 142),
    _t1('18.4B', 8, 1, 256, 1024, 135),
    _t1('39.1B', 8, 2, 512, 1536, 138, repeats=2),
    _t1('76.1B', 8, 4, 1024, 1792, 140, repeats=3),
    _t1('145.6B', 8, 8, 1536, 2304, 148, repeats=2),
    _t1('310.1B', 8, 16, 1920, 2160, 155, repeats=2),
    _t1('530B', 8, 35, 2520, 2520, 163, repeats=3),
    _t1('1T', 8, 64, 3072, 3072, 163, repeats=2),
)

_T2_175B = 'tensor 8 x pipeline 12 for model-parallel 96, v 2'
# fmt: off
HELD_BACK = (
    Row(NARAYANAN_T2, '175B', 8, 12, 384, 1536, tflops=153, repeats=2, assumed=_T2_175B),
    Row(NARAYANAN_T2, '175B', 8, 12, 768, 1536, tflops=149, repeats=2, assumed=_T2_175B),
    Row(NARAYANAN_T2, '175B', 8, 12, 1536, 1536, tflops=141, repeats=2, assumed=_T2_175B),
    Row(NARAYANAN_T2, '530B', 8, 35, 560, 2240, tflops=171, repeats=3, assumed='v 3'),
    Row(NARAYANAN_T2, '530B', 8, 35, 1120, 2240, tflops=167, repeats=3, assumed='v 3'),
    Row(NARAYANAN_T2, '530B', 8, 35, 2240, 2240, tflops=159, repeats=3, assumed='v 3'),
    Row(KORTHIKANTI_T5, '22B', 8, 1, 8, 4, seconds=1.42, micro_batch=4),
    Row(KORTHIKANTI_T5, '22B', 8, 1, 8, 4, seconds=1.10, micro_batch=4, remat='selective',
        sequence_parallel=True),  # fmt: skip
    Row(KORTHIKANTI_T5, '175B', 8, 8, 64, 64, seconds=18.13, repeats=3),
    Row(KORTHIKANTI_T5, '175B', 8, 8, 64, 64, seconds=13.75, repeats=3, remat='selective',
        sequence_parallel=True),  # fmt: skip
    Row(KORTHIKANTI_T5, '530B', 8, 35, 280, 280, seconds=49.05, repeats=3),
    Row(KORTHIKANTI_T5, '530B', 8, 35, 280, 280, seconds=37.83, repeats=3, remat='selective',
        sequence_parallel=True),  # fmt: skip
    Row(KORTHIKANTI_T5, '1T', 8, 64, 512, 512, seconds=94.42, assumed='v 1'),
    Row(KORTHIKANTI_T5, '1T', 8, 64, 512, 512, seconds=71.49, remat='selective',
        sequence_parallel=True, assumed='v 1'),  # fmt: skip
    Row(KORTHIKANTI_6_3, '530B', 8, 35, 2240, 2240, seconds=39.15, repeats=3,
        remat='selective', sequence_parallel=True),  # fmt: skip
    Row(MTNLG, '530B', 8, 35, 2240, 1920, seconds=60.1),
    Row(MTNLG, '530B', 8, 35, 2800, 1920, seconds=50.2),
    Row(MTNLG, '530B', 8, 35, 3360, 1920, seconds=44.4),
)
# fmt: on

ROWS = TABLE_1 + HELD_BACK


def config_of(row, compute_dtype='bfloat16'):
    """The resolved config of a row's run (the defaults' data and optimizer keys; no ramp)."""
    from mtnlg_jax import config as config_lib  # noqa: PLC0415

    heads, hidden, layers = SHAPES[row.model]
    config = config_lib.defaults()
    config.mesh.update(dict(data=row.data, stage=row.stage, tensor=row.tensor))
    config.pipeline.repeats = row.repeats
    config.pipeline.schedule = 'interleaved' if row.repeats > 1 else '1f1b'
    config.model.update(
        dict(
            num_layers=layers,
            hidden=hidden,
            heads=heads,
            seq_len=2048,
            vocab_size=51200,
            compute_dtype=compute_dtype,
            remat=row.remat,
            sequence_parallel=row.sequence_parallel,
        )
    )
    config.train.update(dict(global_batch=row.global_batch, micro_batch=row.micro_batch))
    return config_lib.resolve(ml_collections.ConfigDict(config.to_dict()), row.gpus)


def published_seconds(row, hardware_flops):
    """The row's iteration time: published, or its eq.-3 FLOPs / (GPUs x TFLOP/s)."""
    if row.seconds is not None:
        return row.seconds
    return hardware_flops / (row.gpus * row.tflops * 1e12)
