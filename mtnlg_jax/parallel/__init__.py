"""The mesh, the rule table and the engines that run the model over it (never imports model/).

mesh.py              the mesh (data x stage x tensor), made in one place
rules.py             logical axis names -> mesh axes; ZeRO-1 specs
context.py           context parallelism's chunk layout (rank r: chunks r and 2c - 1 - r)
footprint.py         bytes per device of a sharded state
zero.py              the reduce-scatter / all-gather of ZeRO-1
engine.py            engine(config): the sequential, 1F1B / interleaved or GPipe engine
schedule.py          the 1F1B / interleaved schedule as a table
zero_bubble.py       the ZB-H1 table: each backward split into B and W slots
zero_bubble_v.py     the ZB-V table: the same, two chunks a stage in a V
pipeline.py          the 1F1B / interleaved engine in shard_map
tick_by_slot.py      that engine's tick, each slot a conditional; the stages' hand-offs
steady_tick.py       its tick as one switch over the (forward, backward) slot pairs
reducing_tick.py     its tick with ZeRO-1's reduce-scatter in the backward's switch
gathering_tick.py    its first ticks with ZeRO-1's all-gather of chunks 1.. in the forward's
backward_slot.py     a tick's backward slot: gradients into the fp32 accumulators; B, W
stage.py             a stage and one chunk's work on it: forward, VJP, head, loss
slots.py             its slot buffers read and written in place, its fp32 adds
chained.py           the fused accumulation: each chunk's backward a conditional adding its dW
grad_reduce.py       ZeRO-1's reduce-scatter of a finished chunk inside a later backward slot,
                     its all-gather of a later chunk inside chunk 0's first forward slots
gpipe.py             the GPipe engine (autodiff through the forwards)
stage_functions.py   the model's pieces an engine is handed, the micro-batch a chunk gets
stage_order.py       blocks stored stage-major; which chunk a stage runs (the V's too)
residuals.py         a VJP taken apart for the residual slots
offload.py           residual slots in host memory (model.remat_offload)
taps.py              the block matmuls' taps: ZB-H1's W from the x and dy that B stashes
branches.py          slot kinds, the table's columns in groups, how often each branch runs
"""
