"""Reference values for the ported neural-tangents tests (tests/test_nt_ported_*.py).

Run with neural-tangents 0.6.5 on jax 0.4.30 (it does not import on current JAX):

    python3 -m venv /tmp/ntref
    /tmp/ntref/bin/pip install jax==0.4.30 jaxlib==0.4.30 neural-tangents==0.6.5
    cd tests && /tmp/ntref/bin/python data/make_neural_tangents_ported.py

Float64 throughout. ``jax_threefry_partitionable=True`` (current JAX's default, not
0.4.30's) so that ``init_fn(PRNGKey(0), ...)`` draws the parameters memwise.nt draws.
Writes data/neural_tangents_ported.npz; the networks are those of _nt_ported_cases.py.
"""

import os
import sys

import jax

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_threefry_partitionable", True)

import neural_tangents as nt  # noqa: E402
import numpy as np  # noqa: E402
from jax import random  # noqa: E402
from neural_tangents import stax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _nt_ported_cases as cases  # noqa: E402

out = {}


def kernels(prefix, kernel_fn, x1, x2):
    k = kernel_fn(x1, x2, ("nngp", "ntk"))
    out[prefix + "/nngp"] = np.asarray(k.nngp)
    out[prefix + "/ntk"] = np.asarray(k.ntk)


# stax_test: exact, layernorm, pool, linear, nonlinear
for case in cases.exact_cases():
    net, shape = cases.build_net(stax, **case)
    x1, x2 = cases.inputs(1, shape)
    kernels("exact/" + cases.case_id(case), net[2], x1, x2)

for case in cases.layernorm_cases():
    kw = dict(case)
    kw["layer_norm"] = cases.layernorm_axis(case["model"], case["layer_norm"])
    net, shape = cases.build_net(stax, **kw)
    x1, x2 = cases.inputs(1, shape)
    kernels("layernorm/" + cases.case_id(case), net[2], x1, x2)

for case in cases.pool_cases():
    net = cases.build_pool(stax, **case)
    x1, x2 = cases.inputs(1, cases.INPUT_SHAPE)
    kernels("pool/" + cases.case_id(case), net[2], x1, x2)

for case in cases.linear_cases():
    net = cases.build_linear(stax, **case)
    for same in (True, False):
        x1, x2 = cases.inputs(1, (cases.BATCH_SIZE, 3), same)
        kernels(f"linear/{cases.case_id(case)}-same={same}", net[2], x1, x2)

for case in cases.nonlinear_cases():
    kw = dict(case)
    net, shape = cases.build_net(stax, **kw)
    x1, x2 = cases.inputs(1, shape)
    kernels("nonlinear/" + cases.case_id(case), net[2], x1, x2)

# branching_test: FanInConcat on the channel axis
for case in cases.fan_in_cases():
    net = cases.build_fan_in(stax, **case)
    x1, x2 = cases.fan_in_inputs(case["model"])
    kernels("fan_in/" + cases.case_id(case), net[2], x1, x2)
    out[f"fan_in/{cases.case_id(case)}/x1"], out[f"fan_in/{cases.case_id(case)}/x2"] = x1, x2

# empirical_test: testNTKAgainstDirect, testAxes (JACOBIAN_CONTRACTION, vmap_axes=None)
for train, test, network in cases.EMPIRICAL_SHAPES:
    for logits in (1, 2, 3):
        init_fn, f, _ = cases.build_empirical(stax, train[1:], network, logits)
        _, params = init_fn(random.PRNGKey(0), (-1,) + train[1:])
        x1, _ = cases.inputs(2, train, True)
        x2, _ = cases.inputs(3, test, True)
        key = f"direct/{train}-{network}-{logits}"
        ntk_fn = nt.empirical_ntk_fn(f, trace_axes=(), implementation=1)
        nngp_fn = nt.empirical_nngp_fn(f, trace_axes=())
        out[key + "/ntk_same"] = np.asarray(ntk_fn(x1, None, params))
        out[key + "/ntk"] = np.asarray(ntk_fn(x1, x2, params))
        out[key + "/nngp"] = np.asarray(nngp_fn(x1, x2, params))

init_fn, f, _ = cases.build_empirical(stax, (5, 6, 3), "CONV", 3)
_, params = init_fn(random.PRNGKey(0), (-1, 5, 6, 3))
x1, _ = cases.inputs(4, (4, 5, 6, 3), True)
x2, _ = cases.inputs(5, (2, 5, 6, 3), True)
for d, t in cases.axes_cases():
    key = "axes/" + cases.axes_key(d, t)
    ntk_fn = nt.empirical_ntk_fn(f, trace_axes=t, diagonal_axes=d, implementation=1)
    out[key + "/ntk_same"] = np.asarray(ntk_fn(x1, None, params))
    out[key + "/nngp_same"] = np.asarray(nt.empirical_nngp_fn(f, t, d)(x1, None, params))
    if 0 not in {a % 4 for a in t + d}:
        out[key + "/ntk"] = np.asarray(ntk_fn(x1, x2, params))

# predict_test: matrix versions with nonzero initial outputs, times arrays
rng = np.random.default_rng(6)
x_train, x_test = rng.normal(size=(8, 5)), rng.normal(size=(3, 5))
y_train = rng.normal(size=(8, 2))
_, _, kernel_fn = stax.serial(stax.Dense(512, W_std=1.5, b_std=0.2), stax.Erf(), stax.Dense(1))
k_dd = kernel_fn(x_train, None, ("nngp", "ntk"))
k_td = kernel_fn(x_test, x_train, ("nngp", "ntk"))
k_tt = kernel_fn(x_test, None, ("nngp", "ntk"))
fx_train_0, fx_test_0 = rng.normal(size=(8, 2)), rng.normal(size=(3, 2))
ts = np.array([0.0, 0.5, 3.0, 50.0])
for reg, absolute in ((0.0, False), (1e-2, False), (1e-2, True)):
    tag = f"reg={reg}-abs={absolute}"
    fn = nt.predict.gradient_descent_mse(
        k_dd.ntk, y_train, learning_rate=0.7, diag_reg=reg, diag_reg_absolute_scale=absolute
    )
    tr, te = fn(ts, fx_train_0, fx_test_0, k_td.ntk)
    out[f"gd_mse/{tag}/train"], out[f"gd_mse/{tag}/test"] = np.asarray(tr), np.asarray(te)
    tr, te = fn(None, fx_train_0, fx_test_0, k_td.ntk)
    out[f"gd_mse/{tag}/train_inf"], out[f"gd_mse/{tag}/test_inf"] = np.asarray(tr), np.asarray(te)
    gp = nt.predict.gp_inference(k_dd, y_train, diag_reg=reg, diag_reg_absolute_scale=absolute)
    res = gp(None, k_td, k_tt)
    for g in ("nngp", "ntk"):
        out[f"gp/{tag}/{g}/mean"] = np.asarray(getattr(res, g).mean)
        out[f"gp/{tag}/{g}/cov"] = np.asarray(getattr(res, g).covariance)
ens = nt.predict.gradient_descent_mse_ensemble(
    kernel_fn, x_train, y_train, learning_rate=0.7, diag_reg=1e-2
)
res = ens(ts, x_test, None, compute_cov=True)
for g in ("nngp", "ntk"):
    out[f"ensemble/{g}/mean"] = np.asarray(getattr(res, g).mean)
    out[f"ensemble/{g}/cov"] = np.asarray(getattr(res, g).covariance)
out["predict/x_train"], out["predict/x_test"], out["predict/y_train"] = x_train, x_test, y_train
out["predict/fx_train_0"], out["predict/fx_test_0"], out["predict/ts"] = fx_train_0, fx_test_0, ts
# max_learning_rate is not stored: its CPU path calls scipy.linalg.eigvalsh(eigvals=...), gone from SciPy.

path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "neural_tangents_ported.npz")
np.savez_compressed(path, **out)
print(len(out), "arrays ->", path)
