"""What a run costs before it runs: arithmetic, cluster figures, and the compiled step.

    arithmetic.py    memory per device of state and activations, FLOPs (no devices)
    comm.py          bytes per step by collective and mesh axis (formulas)
    clusters.py      per-GPU figures of named clusters (peak FLOP/s, HBM, links), fit
    predict.py       the step-time model (compute, exposed communication, bubble)
    published.py     published runs the model is checked against
    search.py        the layouts that fit, ranked by predicted step time
    hlo_module.py    an optimized HLO module's text read: computations, runs per step, FLOPs
    hlo.py           the collective inventory of an optimized HLO module
    overlap.py       the replay of a compiled step: compute by kind, communication, overlap
    lockstep.py      the same with each pipeline tick at its slowest stage: the bubble
    pgle.py          the replay's costs as XLA:GPU's latency profile (launch/plan.py --pgle)
    loop_copies.py   the copies a compiled step makes inside its loops
    matmul_sites.py  which matmuls of an FP8 step stayed out of FP8, and why
    gpu_target.py    XLA:GPU compile-only devices for a named GPU
    compile.py       the train and eval steps launch/train.py runs, compiled on abstract state
    report.py        the plan as one JSON-ready dict, the compiled figures beside it
    printout.py      the plan as the table launch/plan.py prints

plan sits above train: it compiles the trainer's own step; train imports nothing from it.
"""
