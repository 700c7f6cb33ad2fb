"""The model's pieces a pipeline engine runs, handed to it by its caller.

Imports flow one way, config -> parallel -> model -> train -> launch (docs/design.md, "Layers"):
the engines (pipeline.py, gpipe.py) sit below the model and import nothing from it. The train
step builds these functions from its model (`gpt.stage_functions(graphdef)`) and passes them
in. An engine sees the parameters as a plain dict: the block stack under 'blocks', stacked on
a leading layer axis, and the rest (`shared_params`), which every stage holds.

    embed(shared, tokens, row_keys)           tokens (..., seq) -> hidden (..., seq, embed):
                                              token + position embeddings, dropout (chunk 0)
    apply_blocks(chunk, hidden, row_keys,     consecutive blocks scanned over hidden, layer
                 first_layer, remat)          first_layer first (dropout), each under the
                                              policy `remat` names ('none': none)
    head_loss_sum(shared, hidden, labels)     summed loss of hidden (rows, seq, embed): final
                                              norm, tied head and cross-entropy fused
    logits_loss_sum(shared, hidden, labels)   the same through the whole fp32 logits, which
                                              autodiff keeps (GPipe order's head)

row_keys: one dropout key per sequence, or None for no dropout.
"""

import dataclasses
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class StageFunctions:
    """The model's pieces (the module's table), built by the model and passed in by the
    engines' caller: the parallel layer, below the model, never imports it."""

    embed: Callable
    apply_blocks: Callable
    head_loss_sum: Callable
    logits_loss_sum: Callable
    remat: str  # 'none', 'full' or 'selective': what apply_blocks recomputes per layer
    remat_policy: Any  # remat's jax.checkpoint policy (None for 'none')
    dtype: Any  # the compute dtype of the activations


def shared_params(params):
    """Every parameter outside the block stack (embeddings, final norm): each stage holds all."""
    return {k: v for k, v in params.items() if k != 'blocks'}
