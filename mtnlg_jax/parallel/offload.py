"""Residual slots in the host's memory (model.remat_offload): the 1F1B engine's own moves.

    forward tick   kept residuals (device) --stack--> host --DUS--> buffer[resid_slot]
    backward tick  buffer[resid_slot] --dynamic slice--> device --unstack--> the VJP

JAX's offloading policy (jax.checkpoint_policies.save_and_offload_only_these_names) moves a
named output to the host inside the forward's own computation; in this engine that is a
conditional, and a host array leaving one makes XLA:GPU write its slot on the CPU (its host
compute). So the engine traces its forwards with the names kept on the device, learns from
a probe under the policy which residuals it would have moved (`hosted`), and moves those
itself, outside every conditional: XLA:GPU then copies each slot between the GPU and a pinned
host buffer asynchronously (dynamic-slice and dynamic-update-slice fusions on their own
stream), which the latency-hiding scheduler overlaps with the tick's work, and the GPU holds
none of those slots. Residuals alike in shape and dtype share one host buffer, so that a tick
moves one slice each way (XLA:GPU keeps two such copies in flight: four of SwiGLU's gate and
up each way a tick left half of them waiting). A tick's backward reads its slice as the tick
starts (`fetch`), beside the forward. An idle forward writes into a spare slot at the buffer's
end, so that a write needs no read of the slot it keeps (a read would be a copy back).
"""

import collections

import jax
import jax.numpy as jnp

from mtnlg_jax.parallel import slots

HOST, DEVICE = jax.memory.Space.Host, jax.memory.Space.Device


def hosted(forward, *args):
    """Which of `forward(*args)`'s kept residuals (split_vjp's second) its remat policy puts
    in host memory, traced abstractly."""
    jaxpr = jax.make_jaxpr(lambda *a: forward(*a)[1])(*args)
    return tuple(v.aval.memory_space == HOST for v in jaxpr.jaxpr.outvars)


class Slots:
    """Where a stage's kept residuals wait between forward and backward: a buffer of slots
    on the device for each residual the GPU keeps, in their order (without offloading, that
    is all), then one in host memory for each group of hosted residuals alike in shape and
    dtype, with a spare slot."""

    def __init__(self, shapes, hosted):
        self.shapes, self.hosted = list(shapes), tuple(hosted)
        groups = collections.defaultdict(list)
        for i, (shape, host) in enumerate(zip(self.shapes, self.hosted)):
            if host:
                groups[shape.shape, jnp.dtype(shape.dtype)].append(i)
        self.device = [i for i, host in enumerate(self.hosted) if not host]
        self.groups = list(groups.values())

    def buffers(self, slot_count, fill):
        """The stage's residual buffers; a host one is a host scalar broadcast, which XLA:GPU
        allocates in host memory unwritten, laid out as its sharding propagates (a buffer
        filled on the GPU would be copied over whole each step)."""
        device = [
            jnp.full((slot_count, *self.shapes[i].shape), fill(self.shapes[i].dtype),
                     self.shapes[i].dtype)
            for i in self.device
        ]  # fmt: skip
        host = [
            jax.lax.broadcast(
                jax.device_put(jnp.zeros((), self.shapes[g[0]].dtype), HOST),
                (slot_count + 1, len(g), *self.shapes[g[0]].shape),
            )
            for g in self.groups
        ]
        return device + host

    def zeros(self):
        """An idle forward's residuals."""
        return [jnp.zeros(s.shape, s.dtype) for s in self.shapes]

    def write(self, buffers, slot, ran, kept):
        """The buffers with `kept` in `slot` where `ran` (a host group's idle write: the
        spare slot)."""
        device, host = buffers[: len(self.device)], buffers[len(self.device) :]
        device = [slots.write(b, slot, ran, kept[i]) for b, i in zip(device, self.device)]
        for k, (b, g) in enumerate(zip(host, self.groups)):
            where = jnp.where(ran, slot, b.shape[0] - 1)
            moved = jax.device_put(jnp.stack([kept[i] for i in g]), HOST)
            host[k] = jax.lax.dynamic_update_index_in_dim(b, moved, where, 0)
        return device + host

    def read(self, buffers, slot, fetched=None):
        """The residuals in `slot`, on the device; fetched: `fetch`'s host groups, or None."""
        kept = [None] * len(self.shapes)
        for b, i in zip(buffers, self.device):
            kept[i] = slots.read(b, slot)
        fetched = fetched if fetched is not None else self._fetched(buffers, slot)
        for values, g in zip(fetched, self.groups):
            for k, i in enumerate(g):
                kept[i] = values[k]
        return kept

    def fetch(self, buffers, slot):
        """(A tick's backward residuals from the host groups, read as the tick starts; the
        buffers). The slot a backward reads is never the one its tick's forward writes
        (schedule.py frees a slot the tick after its backward), so the copies back run
        beside the forward; the barrier orders the reads before the forward's write, which
        then updates each buffer in place (without it XLA copies the whole buffer each tick
        to keep the version read)."""
        if not self.groups:
            return None, buffers
        device, host = buffers[: len(self.device)], buffers[len(self.device) :]
        fetched, host = jax.lax.optimization_barrier((self._fetched(buffers, slot), host))
        return fetched, device + list(host)

    def _fetched(self, buffers, slot):
        host = buffers[len(self.device) :]
        return [jax.device_put(slots.read(b, slot), DEVICE) for b in host]


# XLA:GPU of jaxlib 0.10.2 aborts in its analytical latency estimator on a step that moves
# slots to the host (a failed check in CalculateLaunchDimensions, the estimator pricing the
# asynchronous slice fusions): such a step is scheduled by XLA's default estimator instead.
ESTIMATOR_OPTION = 'xla_gpu_enable_analytical_latency_estimator'


def compiler_options(offloading):
    """jax.jit's compiler_options for a train step that holds residuals on the host, else none
    (XLA:CPU ignores them)."""
    return {ESTIMATOR_OPTION: False} if offloading else {}
