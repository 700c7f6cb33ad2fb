"""Residual slots in the host's memory (model.remat_offload): the 1F1B engine's own moves.

    forward tick   kept residual (device) --device_put--> host --DUS--> buffer[resid_slot]
    backward tick  buffer[resid_slot] --dynamic slice--> host --device_put--> device --> VJP

JAX's offloading policy (jax.checkpoint_policies.save_and_offload_only_these_names) moves a
named output to the host inside the forward's own computation; in this engine that is a
conditional, and a host array leaving one makes XLA:GPU write its slot on the CPU (its host
compute). So the engine traces its forwards with the names kept on the device, learns from
a probe under the policy which residuals it would have moved (`hosted`), and moves those
itself, outside every conditional: XLA:GPU then copies each slot between the GPU and a pinned
host buffer asynchronously (dynamic-slice and dynamic-update-slice fusions on their own
stream), which the latency-hiding scheduler overlaps with the tick's work, and the GPU holds
none of those slots. An idle forward writes its zeros into a spare slot at the buffer's end,
so that a write needs no read of the slot it keeps (a read would be a copy back).
"""

import jax
import jax.numpy as jnp

from mtnlg_jax.parallel import slots

HOST, DEVICE = jax.memory.Space.Host, jax.memory.Space.Device


def hosted(forward, *args):
    """Which of `forward(*args)`'s kept residuals (split_vjp's second) its remat policy puts
    in host memory, traced abstractly."""
    jaxpr = jax.make_jaxpr(lambda *a: forward(*a)[1])(*args)
    return tuple(v.aval.memory_space == HOST for v in jaxpr.jaxpr.outvars)


def buffer(slot_count, shape, dtype, fill, host):
    """A residual's slots: on the device, or in host memory with one spare slot. A host
    buffer is a host scalar broadcast, which XLA:GPU allocates in host memory unwritten, laid
    out as its sharding propagates (a buffer filled on the GPU would be copied over whole each
    step; lax.empty's allocation is not sharded)."""
    if not host:
        return jnp.full((slot_count, *shape), fill, dtype)
    return jax.lax.broadcast(jax.device_put(jnp.zeros((), dtype), HOST), (slot_count + 1, *shape))


def write(buffer, slot, ran, value, host):
    """buffer[slot] = value where `ran`; a host buffer's idle write goes to its spare slot."""
    if not host:
        return slots.write(buffer, slot, ran, value)
    slot = jnp.where(ran, slot, buffer.shape[0] - 1)
    return jax.lax.dynamic_update_index_in_dim(buffer, jax.device_put(value, HOST), slot, 0)


def fetch(hosted, resids, slot):
    """A tick's backward residuals from its host buffers, read as the tick starts: (their
    device copies, None for a device buffer; the buffers). The slot a backward reads is never
    the one its tick's forward writes (schedule.py frees a slot the tick after its
    backward), so the copies back run beside the forward; the barrier orders the reads
    before the forward's write, which then updates each buffer in place (without it XLA
    copies the whole buffer each tick to keep the version read)."""
    if not any(hosted):
        return [None] * len(resids), resids
    fetched = [read(b, slot, True) if host else None for b, host in zip(resids, hosted)]
    on_host = [b for b, host in zip(resids, hosted) if host]
    fetched, on_host = jax.lax.optimization_barrier((fetched, on_host))
    on_host = iter(on_host)
    return fetched, [next(on_host) if host else b for b, host in zip(resids, hosted)]


def read(buffer, slot, host):
    """buffer[slot], on the device."""
    value = slots.read(buffer, slot)
    return jax.device_put(value, DEVICE) if host else value


# XLA:GPU of jaxlib 0.10.2 aborts in its analytical latency estimator on a step that moves
# slots to the host (a failed check in CalculateLaunchDimensions, the estimator pricing the
# asynchronous slice fusions): such a step is scheduled by XLA's default estimator instead.
ESTIMATOR_OPTION = 'xla_gpu_enable_analytical_latency_estimator'


def compiler_options(offloading):
    """jax.jit's compiler_options for a train step that holds residuals on the host, else none
    (XLA:CPU ignores them)."""
    return {ESTIMATOR_OPTION: False} if offloading else {}
