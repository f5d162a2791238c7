"""DP matrix factorization (correlated noise): strategies and their analysis.

NumPy/SciPy only. The pipeline of a DP-MF run:

    workloads  ->  strategies  ->  sensitivity / error  ->  optimize
    (A: prefix     (C: identity,    (sens(C) under k       (BandMF, BLT,
     sums, ...)     Toeplitz, BLT,   participations; RMSE,  dense optimum)
                    dense)           max error of A C⁻¹)

The train step streams (C⁻¹z)_t with ``tf_dpadambc.CorrelatedNoise``.
"""
from tf_dpadambc.mf.strategies import BLT
from tf_dpadambc.mf.strategies import Dense
from tf_dpadambc.mf.strategies import Identity
from tf_dpadambc.mf.strategies import Strategy
from tf_dpadambc.mf.strategies import Toeplitz
from tf_dpadambc.mf.strategies import sqrt_toeplitz
from tf_dpadambc.mf.workloads import decayed_prefix_sums
from tf_dpadambc.mf.workloads import momentum_prefix_sums
from tf_dpadambc.mf.workloads import prefix_sums
from tf_dpadambc.mf.error import max_error
from tf_dpadambc.mf.error import rmse
from tf_dpadambc.mf.optimize import banded_objective
from tf_dpadambc.mf.optimize import optimize_banded
from tf_dpadambc.mf.optimize import optimize_blt
from tf_dpadambc.mf.optimize import optimize_dense
from tf_dpadambc.mf.sensitivity import (
    blt_single_participation_sensitivity_squared)
from tf_dpadambc.mf.sensitivity import brute_force_sensitivity
from tf_dpadambc.mf.sensitivity import sensitivity
from tf_dpadambc.mf.sensitivity import sensitivity_upper_bound
