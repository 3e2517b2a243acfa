"""neural-tangents 0.6.5's test networks, written once for both libraries.

Each builder takes a ``stax`` module (``neural_tangents.stax`` in the reference script
tests/data/make_neural_tangents_ported.py, ``memwise.nt.stax`` in the ported tests) and
returns the network the upstream test builds, in NHWC / NC layout (the upstream tests
also draw random dimension orders, which memwise.nt does not support). Inputs come from
NumPy's generator so that both environments see the same numbers. Only NumPy and the
given module are used here: this file runs under jax 0.4.30 too.
"""

from __future__ import annotations

import itertools

import _draw
import numpy as np

BATCH_SIZE = 4
INPUT_SHAPE = (BATCH_SIZE, 8, 6, 2)
FILTER_SHAPES = [(2, 1), (3, 2)]
STRIDES = [(1, 2), (2, 1)]
W_STD, B_STD = 2.0**0.5, 0.5**0.5


def inputs(seed: int, shape: tuple, same_inputs: bool = False):
    """``cos`` of standard normals, and a second set of twice the batch (upstream's
    ``_get_inputs``), or None."""
    rng = np.random.default_rng(seed)
    x1 = np.cos(rng.normal(size=shape))
    if same_inputs:
        return x1, None
    return x1, 2 * np.cos(rng.normal(size=(2 * shape[0],) + tuple(shape[1:])))


# ----------------------------------------------------------------------------------------
# stax_test.py: StaxTest.test_exact, test_layernorm, test_pool; ParameterizationTest


def exact_cases() -> list[dict]:
    """test_exact's grid that applies (no CIRCULAR padding, no attention projection)."""
    cases = []
    for model, padding, strides, filter_shape, pooling, is_ntk, is_res, proj in itertools.product(
        ["fc", "conv"],
        ["SAME", "VALID"],
        STRIDES,
        FILTER_SHAPES,
        [False, True],
        [False, True],
        [False, True],
        ["FLAT", "POOL"],
    ):
        if model == "conv":
            # Upstream's skips: residual branches must keep the shape.
            if is_res and (strides != (1, 1) or (padding == "VALID" and filter_shape != (1, 1))):
                continue
            # Pooling after VALID convolutions pads CIRCULAR upstream: not supported.
            if pooling and padding == "VALID":
                continue
        elif (
            filter_shape != FILTER_SHAPES[0]
            or padding != "SAME"
            or strides != STRIDES[0]
            or proj != "FLAT"
            or pooling
        ):
            continue
        cases.append(
            dict(
                model=model,
                padding=padding,
                strides=strides,
                filter_shape=filter_shape,
                use_pooling=pooling,
                is_ntk=is_ntk,
                is_res=is_res,
                proj=proj,
            )
        )
    return cases


def build_net(
    stax,
    *,
    model,
    padding="SAME",
    strides=STRIDES[0],
    filter_shape=FILTER_SHAPES[0],
    use_pooling=False,
    is_ntk=False,
    is_res=False,
    proj="FLAT",
    W_std=W_STD,  # noqa: N803
    b_std=B_STD,
    layer_norm=None,
    width=1024,
    parameterization="ntk",
    s=1,
):
    """Upstream's ``_get_net`` in NHWC with ``phi = Relu()``; returns (layer, input shape)."""
    is_conv = model == "conv"
    input_shape = INPUT_SHAPE if is_conv else (INPUT_SHAPE[0], int(np.prod(INPUT_SHAPE[1:])))
    scaled = dict(W_std=W_std, b_std=b_std, parameterization=parameterization)

    def fc(out_dim, s):
        return stax.Dense(out_dim, s=s, **scaled)

    def conv(out_chan, s):
        return stax.Conv(out_chan, filter_shape, strides=strides, padding=padding, s=s, **scaled)

    affine = conv(width, (s, s)) if is_conv else fc(width, (s, s))
    affine_bottom = conv(width, (1, s)) if is_conv else fc(width, (1, s))
    pool = stax.AvgPool((2, 3), None, "SAME") if use_pooling else stax.Identity()
    norm = stax.Identity() if layer_norm is None else stax.LayerNorm(axis=layer_norm)
    res_unit = stax.serial(stax.Identity(), affine, pool)
    if is_res:
        block = stax.serial(
            affine_bottom,
            stax.FanOut(2),
            stax.parallel(stax.Identity(), res_unit),
            stax.FanInSum(),
            norm,
            stax.Relu(),
        )
    else:
        block = stax.serial(affine_bottom, res_unit, norm, stax.Relu())
    projection = stax.Flatten() if proj == "FLAT" else stax.GlobalAvgPool()
    readout = stax.serial(projection, fc(1 if is_ntk else width, (s, 1 if is_ntk else s)))
    return stax.serial(block, readout), input_shape


def layernorm_cases() -> list[dict]:
    """test_layernorm's grid in NHWC: normalisation axes as upstream's letters."""
    cases = []
    for model, is_ntk, proj, axes in itertools.product(
        ["fc", "conv"], [False, True], ["FLAT", "POOL"], ["C", "HC", "CHW", "NC", "NWC", "NCHW"]
    ):
        if model == "fc" and (proj != "FLAT" or axes not in ("C", "NC")):
            continue
        cases.append(dict(model=model, is_ntk=is_ntk, proj=proj, layer_norm=axes))
    return cases


def layernorm_axis(model: str, letters: str) -> tuple[int, ...]:
    """Upstream's axis letters as negative axes (the same axes, whatever the rank)."""
    spec = "NHWC" if model == "conv" else "NC"
    return tuple(spec.index(c) - len(spec) for c in letters)


def pool_cases() -> list[dict]:
    """test_pool's grid that applies: AvgPool without normalize_edges, SAME/VALID."""
    return [
        dict(is_ntk=n, padding=p, filter_shape=f, strides=s)
        for n, p, f, s in itertools.product(
            [False, True], ["SAME", "VALID"], FILTER_SHAPES, STRIDES
        )
    ]


def build_pool(stax, *, is_ntk, padding, filter_shape, strides, width=1024):
    """Upstream's ``_get_net_pool`` for ``pool_type="AVG"``."""

    def conv():
        return stax.Conv(
            width, filter_shape, strides=None, padding="SAME", W_std=W_STD, b_std=B_STD
        )

    return stax.serial(
        conv(),
        stax.Relu(),
        stax.AvgPool(filter_shape, strides, padding),
        conv(),
        stax.Relu(),
        stax.GlobalAvgPool(),
        stax.Dense(1 if is_ntk else width, W_std=W_STD, b_std=B_STD),
    )


def linear_cases() -> list[dict]:
    """ParameterizationTest.test_linear's grid: the NTK parameterization, and the standard
    one at each width scaling ``s`` (the NTK one does not depend on it)."""
    grid = list(
        itertools.product(["nngp", "ntk"], [0, 1, 2], [0.0, 1.0, 2.0], [None, 0.0, 0.5**0.5, 2.0])
    )
    ntk = [dict(get=g, depth=d, W_std=w, b_std=b) for g, d, w, b in grid]
    standard = [
        dict(get=g, depth=d, W_std=w, b_std=b, parameterization="standard", s=s)
        for s in (2**9, 2**8, 2**7)
        for g, d, w, b in grid
    ]
    return ntk + standard


def build_linear(stax, *, get, depth, W_std, b_std, parameterization="ntk", s=1):  # noqa: N803
    width = 2**9 // s if parameterization == "standard" else 1024
    layers = []
    for i in range(depth + 1):
        last = i == depth and get == "ntk"
        out_dim = 1 if last else width * (i + 1)
        layers.append(
            stax.Dense(
                out_dim,
                W_std=W_std / (i + 1),
                b_std=None if b_std is None else b_std / (i + 1),
                parameterization=parameterization,
                s=(1 if i == 0 else s, 1 if last else s),
            )
        )
    return stax.serial(*layers)


def nonlinear_cases() -> list[dict]:
    """ParameterizationTest.test_nonlinear's grid, both parameterizations (the standard
    one at ``s = 1024``, width 1, as upstream)."""
    cases = []
    for model, is_ntk, filter_shape, proj, w, b, standard in itertools.product(
        ["fc", "conv"],
        [False, True],
        FILTER_SHAPES,
        ["FLAT", "POOL"],
        [0.0, 1.0, 2.0],
        [None, 0.0, 0.5**0.5],
        [False, True],
    ):
        if model == "fc" and (proj != "FLAT" or filter_shape != FILTER_SHAPES[0]):
            continue
        case = dict(
            model=model, is_ntk=is_ntk, filter_shape=filter_shape, proj=proj, W_std=w, b_std=b
        )
        if standard:
            case.update(parameterization="standard", s=2**10, width=1)
        cases.append(case)
    return cases


def case_id(case: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in case.items()).replace(" ", "")


# ----------------------------------------------------------------------------------------
# empirical_test.py: EmpiricalTest.testNTKAgainstDirect and testAxes

EMPIRICAL_SHAPES = [
    ((4, 4), (2, 4), "FLAT"),
    ((4, 8), (6, 8), "FLAT"),
    ((8, 8), (16, 8), "FLAT"),
    ((6, 4, 4, 3), (2, 4, 4, 3), "FLAT"),
    ((4, 4, 4, 3), (2, 4, 4, 3), "POOLING"),
    ((4, 4, 4, 3), (2, 4, 4, 3), "CONV"),
]


def build_empirical(stax, input_shape, network, out_logits):
    """Upstream's empirical_test ``_build_network``."""
    if len(input_shape) == 1:
        return stax.Dense(out_logits, W_std=2.0, b_std=0.5)
    if network == "POOLING":
        return stax.serial(
            stax.Conv(2, (3, 3), W_std=2.0, b_std=0.05),
            stax.GlobalAvgPool(),
            stax.Dense(out_logits, W_std=2.0, b_std=0.5),
        )
    if network == "CONV":
        return stax.serial(
            stax.Conv(2, (1, 2), W_std=1.5, b_std=0.1),
            stax.Relu(),
            stax.Conv(2, (3, 2), W_std=2.0, b_std=0.05),
        )
    return stax.serial(
        stax.Conv(2, (3, 3), W_std=2.0, b_std=0.05),
        stax.Flatten(),
        stax.Dense(out_logits, W_std=2.0, b_std=0.5),
    )


AXES_DIAGONAL = [
    (),
    (0,),
    (0, 1),
    (0, 1, 2),
    (0, 1, 2, 3),
    (-1,),
    (-2,),
    (0, -1),
    (1, -2),
    (2, 3),
    (3, 0, 2),
]
AXES_TRACE = [
    (),
    (0,),
    (0, 1),
    (-1,),
    (1,),
    (0, -1),
    (-1, -2),
    (0, 1, 2, 3),
    (3, 1, 2, 0),
    (1, 2, 3),
    (-3, -2),
    (-3, -1),
    (-2, -4),
    (2, 0, -1),
]


def axes_cases() -> list[tuple[tuple, tuple]]:
    """testAxes' (diagonal_axes, trace_axes) pairs that do not share an axis."""
    out = []
    for d, t in itertools.product(AXES_DIAGONAL, AXES_TRACE):
        if {a % 4 for a in d} & {a % 4 for a in t}:
            continue
        out.append((d, t))
    return out


def axes_key(d, t) -> str:
    return "d" + "_".join(str(a) for a in d) + "t" + "_".join(str(a) for a in t)


# branching_test.py: FanInTest.test_fan_in_fc / test_fan_in_conv with FanInConcat on the
# channel axis and an affine layer after it ("dense_after_branch_in", the only
# concatenation whose kernel neural-tangents computes before a nonlinearity), and with
# FanInSum after branches that end in an affine layer ("dense_before_branch_in").


def fan_in_cases() -> list[dict]:
    concat = [
        {"mode": "concat", "model": "fc", "n_branches": n, "axis": axis, "readout": "none"}
        for n in (2, 3)
        for axis in (1, -1)
    ] + [
        {"mode": "concat", "model": "conv", "n_branches": 2, "axis": axis, "readout": readout}
        for axis in (3, -1)
        for readout in ("pool", "flatten")
    ]
    summed = [{"mode": "sum", "model": "fc", "n_branches": 3, "axis": None, "readout": "none"}] + [
        {"mode": "sum", "model": "conv", "n_branches": 2, "axis": None, "readout": readout}
        for readout in ("pool", "flatten")
    ]
    return concat + summed


def _phi(stax, i):
    return (stax.Relu(), stax.Erf(), stax.Abs())[i % 3]


def build_fan_in(stax, *, mode, model, n_branches, axis, readout, width=1024):
    """Upstream's network: widths grow by a quarter per branch depth on the channel
    axis, so the concatenation weighs branches of 1,024, 1,024 and 1,280 channels."""
    if model == "fc":
        first = stax.Dense(width, 1.25, 0.1)

        def affine(i, w):
            return stax.Dense(w, 1.0 + 2 * i, 0.5 + i)
    else:
        first = stax.Conv(width, (3, 3), padding="SAME", W_std=1.25, b_std=0.1)

        def affine(i, w):
            return stax.Conv(w, (i + 1, 4 - i), padding="SAME", W_std=1.25 + i, b_std=0.1 + i)

    branches = []
    for b in range(n_branches):
        layers = [_phi(stax, b)]
        for i in range(b):
            multiplier = 1 + 0.25 * i if mode == "concat" else 1
            layers += [affine(i, int(width * multiplier)), _phi(stax, i)]
        if mode == "sum":
            layers.append(first)
        branches.append(stax.serial(*layers))
    if mode == "concat":
        out = [stax.FanInConcat(axis), first, stax.Relu()]
    else:
        out = [stax.FanInSum(), stax.Relu()]
    if readout != "none":
        out.append(stax.GlobalAvgPool() if readout == "pool" else stax.Flatten())
    net = stax.serial(first, stax.FanOut(n_branches), stax.parallel(*branches), *out)
    return stax.serial(net, stax.Dense(1, 1.25, 0.5))


def fan_in_inputs(model):
    from jax import numpy as jnp
    from jax import random

    key = random.PRNGKey(1)
    shape = (4, 3) if model == "fc" else (2, 5, 6, 3)
    x1 = _draw.normal(key, shape)
    x2 = _draw.normal(key, ((8,) + shape[1:]) if model == "fc" else (3,) + shape[1:])
    return (jnp.cos(x1) if model == "fc" else x1), x2
