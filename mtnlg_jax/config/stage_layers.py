"""Layers per pipeline stage: an even share, or first / last stages of their own depth.

    per_stage(126, 16, first=7, last=7) -> (7, 8, 8, ..., 8, 7)     Llama 3 405B, as Meta ran it

Megatron's --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers
(`pipeline.first_stage_layers` / `pipeline.last_stage_layers`, 0: the even share): the first
and the last stage hold what they are given, the other stages share the rest evenly, and with
v chunks a stage (pipeline.repeats) every stage's layers split into v chunks as evenly as they
go (parallel/stage_order.py says which chunk gets the extra layers). Pure
arithmetic: the config's checks and the engines' layout (parallel/stage_order.py) both use it.
With one stage the two keys have nothing to split and change nothing.
"""


def per_stage(num_layers, stages, repeats=1, first=0, last=0):
    """Layers on each stage; ValueError saying which rule fails."""
    given = [n for n in (first, last) if n]
    if not given:
        if num_layers % (stages * repeats):
            raise ValueError(
                f'{num_layers} layers do not divide over {stages} stages x {repeats} chunks'
            )
        return (num_layers // stages,) * stages
    if stages == 1:  # no pipeline: nothing to split (evaluation, a one-stage layout)
        return (num_layers,)
    others, rest = stages - len(given), num_layers - sum(given)
    if others == 0 and rest:
        raise ValueError(f'{first} + {last} layers on the two stages are not {num_layers}')
    if others and (rest <= 0 or rest % others):
        raise ValueError(f'the {rest} layers left do not share evenly over {others} stages')
    share = rest // others if others else 0
    layers = [share] * stages
    layers[0], layers[-1] = first or share, last or share
    fewest = min(layers)
    if fewest < repeats:
        plural = '' if fewest == 1 else 's'
        raise ValueError(f'a stage of {fewest} layer{plural} cannot hold {repeats} chunks')
    return tuple(layers)
