"""Scale rules of the LAX primitives, and the scaling primitives.

Importing this package registers every rule. Rules are grouped by family, one module each.
"""
from . import rules_calls  # noqa: F401  (registers rules)
from . import control_flow  # noqa: F401  (registers rules)
from .primitives import (
    get_data_and_scale,
    get_data_scale,
    get_data_scale_p,
    rebalance,
    rebalance_p,
    set_scaling,
    set_scaling_p,
    stop_scaling,
    stop_scaling_p,
)

# Layout, indexing, gather/scatter and sort rules.
from . import rules_indexing, rules_layout  # noqa: F401  (registers rules)
from .rules_indexing import (
    scaled_approx_top_k,
    scaled_dynamic_slice,
    scaled_dynamic_update_slice,
    scaled_gather,
    scaled_scatter,
    scaled_scatter_add,
    scaled_scatter_max,
    scaled_scatter_min,
    scaled_scatter_mul,
    scaled_sort,
    scaled_top_k,
)
from .rules_layout import (
    scaled_broadcast_in_dim,
    scaled_concatenate,
    scaled_pad,
    scaled_reshape,
    scaled_rev,
    scaled_slice,
    scaled_split,
    scaled_squeeze,
    scaled_transpose,
)

# Reductions, cumulative ops, windows, matmul and convolution rules.
from . import rules_linalg, rules_reduce  # noqa: F401  (registers rules)
from .rules_linalg import scaled_conv_general_dilated, scaled_dot_general
from .rules_reduce import (
    scaled_argmax,
    scaled_argmin,
    scaled_cumlogsumexp,
    scaled_cummax,
    scaled_cummin,
    scaled_cumprod,
    scaled_cumsum,
    scaled_reduce_max,
    scaled_reduce_min,
    scaled_reduce_prod,
    scaled_reduce_sum,
    scaled_reduce_window,
    scaled_reduce_window_max,
    scaled_reduce_window_min,
    scaled_reduce_window_sum,
    scaled_select_and_gather_add,
    scaled_select_and_scatter_add,
)

# Elementwise arithmetic and unary rules.
from . import rules_arithmetic, rules_unary  # noqa: F401  (registers rules)
from .rules_arithmetic import (
    scaled_add,
    scaled_add_any,
    scaled_atan2,
    scaled_clamp,
    scaled_convert_element_type,
    scaled_copy,
    scaled_div,
    scaled_eq,
    scaled_ge,
    scaled_gt,
    scaled_le,
    scaled_lt,
    scaled_max,
    scaled_min,
    scaled_mul,
    scaled_ne,
    scaled_nextafter,
    scaled_pow,
    scaled_reduce_precision,
    scaled_rem,
    scaled_select_n,
    scaled_stop_gradient,
    scaled_sub,
)
from .rules_unary import (
    scaled_abs,
    scaled_acos,
    scaled_acosh,
    scaled_asin,
    scaled_asinh,
    scaled_atan,
    scaled_atanh,
    scaled_cbrt,
    scaled_ceil,
    scaled_cos,
    scaled_cosh,
    scaled_digamma,
    scaled_erf,
    scaled_erf_inv,
    scaled_erfc,
    scaled_exp,
    scaled_exp2,
    scaled_expm1,
    scaled_floor,
    scaled_integer_pow,
    scaled_is_finite,
    scaled_lgamma,
    scaled_log,
    scaled_log1p,
    scaled_logistic,
    scaled_neg,
    scaled_round,
    scaled_rsqrt,
    scaled_sign,
    scaled_sin,
    scaled_sinh,
    scaled_sqrt,
    scaled_square,
    scaled_tan,
    scaled_tanh,
)

# Calls, control flow and checkpoint.
from .rules_calls import scaled_closed_call
from .control_flow import scaled_checkpoint, scaled_cond, scaled_scan, scaled_while

# Host callbacks and sharding constraints.
from . import rules_callbacks, rules_sharding  # noqa: F401  (registers rules)
from .rules_callbacks import scaled_debug_callback, scaled_debug_print, scaled_io_callback, scaled_pure_callback
from .rules_sharding import scaled_sharding_constraint

# Special functions, random sampling, bitcast, generic reduce; name, device_put.
from . import rules_misc, rules_special  # noqa: F401  (registers rules)
from .rules_misc import scaled_device_put, scaled_name
from .rules_special import (
    scaled_bessel_i0e,
    scaled_bessel_i1e,
    scaled_bitcast_convert_type,
    scaled_igamma,
    scaled_igamma_grad_a,
    scaled_igammac,
    scaled_polygamma,
    scaled_random_gamma,
    scaled_reduce,
    scaled_regularized_incomplete_beta,
    scaled_rng_uniform,
    scaled_zeta,
)

# Matrix factorisations and solvers.
from . import rules_linalg_solvers  # noqa: F401  (registers rules)
from .rules_linalg_solvers import (
    scaled_cholesky,
    scaled_custom_linear_solve,
    scaled_eig,
    scaled_eigh,
    scaled_hessenberg,
    scaled_householder_product,
    scaled_lu,
    scaled_qr,
    scaled_schur,
    scaled_svd,
    scaled_triangular_solve,
    scaled_tridiagonal,
    scaled_tridiagonal_solve,
)

# SPMD: shard_map and the collectives.
from . import rules_collectives  # noqa: F401  (registers rules)
from .rules_collectives import (
    scaled_all_gather,
    scaled_all_to_all,
    scaled_pmax,
    scaled_pmin,
    scaled_ppermute,
    scaled_psum,
    scaled_psum_invariant,
    scaled_pvary,
    scaled_reshard,
    scaled_reduce_scatter,
    scaled_shard_map,
)
