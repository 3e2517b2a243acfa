"""Sinkhorn and the Sinkhorn divergence between point clouds, in chunked memory.

Algorithm: entropic optimal transport solved by Sinkhorn's algorithm in the log domain
(Cuturi 2013; Schmitzer 2019 for log-domain stabilisation and epsilon scaling), and the
Sinkhorn divergence with symmetric, averaged updates for its self-transport terms and
optional epsilon annealing (Feydy, Sejourne, Vialard, Amari, Trouve, Peyre 2019,
"Interpolating between Optimal Transport and MMD using Sinkhorn Divergences", Sec. 3.1
and Eq. 25; the GeomLoss library). Every pass over the ``n x m`` cost matrix is a
:func:`memwise.pairwise_reduce`, so no ``n x m`` array exists in any pass.

Gradients. ``reg_ot_cost`` follows the envelope (Danskin) theorem: at the optimal
potentials ``f, g`` the regularised cost ``<a, f> + <b, g> + eps (|a||b| - sum_ij P_ij)``
varies with the points, the weights, epsilon and the cost's parameters as if ``f`` and
``g`` were constants. The solver's ``lax.while_loop`` is never differentiated: the
backward pass is one chunked ``logsumexp`` at the stopped potentials, whose own chunked
vjp yields ``sum_j P_ij grad_x C(x_i, y_j)``: the memory of one forward pass, the time
of about two Sinkhorn iterations. The potentials themselves are differentiated
implicitly (implicit function theorem at the fixed point ``f = T_b(g), g = T_a(f)``;
Luise, Rudi, Pontil, Ciliberto 2018; Eisenberger et al. 2022; OTT-JAX's
``ImplicitDiff``): their backward pass solves one linear system in the plan by conjugate
gradients, two chunked passes a step (at most ``max_iterations`` steps), so it holds
O(n + m + tile) memory too; it runs only when ``f`` or ``g`` is differentiated. As
``(f + t, g - t)`` is as optimal as ``(f, g)``, they are returned in the gauge
``<a, f> = <b, g>``, which makes them a function of the inputs. Both gradients are
exact at convergence only: lower ``threshold`` when they must be accurate.

Unbalanced OT. ``tau_a``/``tau_b`` < 1 (or GeomLoss's ``reach``) relax a marginal by a
KL penalty (Sejourne, Feydy, Vialard, Trouve, Peyre 2019), in OTT-JAX 0.6's convention
(:mod:`memwise.ot.marginals`): the same updates, potentials and ``reg_ot_cost``. That
cost is not stationary at the fixed point of OTT's updates, so its exact gradient adds
the potentials' implicit derivative (``cost_gradient="envelope"`` drops it, as OTT's
default ``use_danskin=True`` does). The plan is an operator on the result
(:class:`memwise.ot.TransportPlan`: ``apply``, ``marginal``, ``transport_cost``, the
entropic map ``transport`` of new points), each one or two chunked passes.

Gromov-Wasserstein (:func:`gromov_wasserstein`, plain and fused, balanced or unbalanced):
each outer iteration linearises the quadratic loss at the current plan into an
inner-product cost of augmented points (the squared Euclidean distances within a cloud
have rank ``d + 2``) and solves it with :func:`sinkhorn` (:mod:`memwise.ot.gromov`;
unbalanced GW's rescaling and correction: :mod:`memwise.ot.gromov_unbalanced`).

Low-rank Sinkhorn (:func:`low_rank_sinkhorn`): the plan ``Q diag(1/g) R^T`` of rank
``r`` by mirror descent on its factors (Scetbon, Cuturi and Peyré 2021; OTT-JAX's
``LRSinkhorn``), the cost applied to them in thin products (squared Euclidean) or
chunked passes (:mod:`memwise.ot.low_rank`).

Only first-order reverse mode is supported (``jax.grad``, ``jax.vjp``, ``jax.jacrev``):
forward mode (``jax.jvp``, ``jax.jacfwd``, ``jax.linearize``) and second derivatives
(``jax.hessian``, grad of grad) raise memwise's ``TypeError``, eagerly and under ``jit``
(a second derivative would silently drop how the potentials move with the points).

Precision: bfloat16 and float16 inputs are solved in float32 (log-domain potentials
with 8 or 11 significant bits cannot resolve ``C / epsilon``) and every result, and the
gradient, comes back in the input's dtype; the tile then holds float32 values.

Conventions match OTT-JAX 0.6 (``ott.solvers.linear.sinkhorn``): ``reg_ot_cost`` is
``min_P <P, C> + eps KL(P | a b^T)``, errors are L1 marginal errors compared with
``threshold``, and ``epsilon=None`` is ``0.05`` times the standard deviation of the cost
matrix (computed here in two chunked passes; floored where that is 0 or degenerate). The potentials differ in one convention:
here ``P_ij = a_i b_j exp((f_i + g_j - C_ij) / eps)``, finite even where a weight is 0,
whereas OTT's ``f`` is ours plus ``eps log a``.
"""

from memwise.ot.api import SinkhornResult, sinkhorn, sinkhorn_divergence

# Names that memwise.ot held as one module, importable from here as before.
from memwise.ot.costs import CostFn as CostFn
from memwise.ot.costs import PNormP
from memwise.ot.gromov import GromovWassersteinResult, gromov_wasserstein
from memwise.ot.low_rank import LowRankSinkhornResult, low_rank_sinkhorn
from memwise.ot.passes import DEFAULT_EPSILON_SCALE as DEFAULT_EPSILON_SCALE
from memwise.ot.plan import TransportPlan
from memwise.tiling import ChunkSize as ChunkSize

__all__ = [
    "GromovWassersteinResult",
    "LowRankSinkhornResult",
    "PNormP",
    "SinkhornResult",
    "TransportPlan",
    "gromov_wasserstein",
    "low_rank_sinkhorn",
    "sinkhorn",
    "sinkhorn_divergence",
]
