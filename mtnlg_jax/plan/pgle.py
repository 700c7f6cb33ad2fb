"""The replay's costs as XLA:GPU's latency profile: profile-guided latency estimation (PGLE)
without a GPU.

XLA:GPU's latency-hiding scheduler orders each computation by its own estimate of every
instruction's cost; compile-only, with nothing measured, that estimate is its analytical
model, which may price a collective below the matmul beside it and so start it too late
(Llama 3 405B at 128K: the keys' and values' reduce-scatter over `context` started after the
queries' backward, 22 % hidden: docs/benchmarks.md). On a GPU, the training loop profiles a
few steps and compiles again with the measured costs (train/pgle.py, as JAX's
`jax_enable_pgle` does for what `jax.jit` calls). Here the
costs are the replay's (plan/overlap.py: matmuls at peak, the rest at HBM bandwidth,
collectives at their link's bandwidth), written as XLA's ProfiledInstructionsProto in text:

    costs { name: "reduce-scatter-start.22" cost_us: 1260.0 }

one row per instruction of the first compile (an async collective by its start), and
`launch/plan.py --pgle` compiles a second time with XLA reading it (OPTION). The second
compile's instruction names are the first's: the same program through the same passes."""

from mtnlg_jax.xla import flags

OPTION = flags.PGLE_PROFILE_OPTION


def costs(replay):
    """[(instruction name, seconds)] of a replayed module (overlap.Replay, after `run`)."""
    rows = []
    for computation, instructions in replay.computations.items():
        types = {i.name: i.type_text for i in instructions}
        for instruction in instructions:
            op = replay.collective(computation, instruction)
            moved = None if op is not None else replay.host_transfer(instruction, types)
            if moved is not None:  # to or from host memory: its time on the host link
                if not instruction.opcode.endswith('-done'):
                    rows.append((instruction.name, replay.host_seconds(moved)))
            elif op is not None:
                if instruction.opcode.endswith('-start') or instruction.opcode == 'async-start':
                    rows.append(
                        (instruction.name, replay.wire_seconds(op, replay.link(op, instruction)))
                    )
            elif not instruction.opcode.endswith('-done'):
                seconds = replay.instruction_seconds(instruction, types, computation)
                if seconds > 0:
                    rows.append((instruction.name, seconds))
    return rows


def write(replay, path):
    """The profile of `replay` at `path` (text format); returns the number of rows."""
    rows = costs(replay)
    with open(path, 'w') as f:
        f.writelines(f'costs {{ name: "{name}" cost_us: {s * 1e6:.3f} }}\n' for name, s in rows)
    return len(rows)
