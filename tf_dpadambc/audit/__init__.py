"""Empirical privacy auditing: ε lower bounds from canary scores."""
from tf_dpadambc.audit.estimators import EpsilonLowerBound
from tf_dpadambc.audit.estimators import FDP_FAMILIES
from tf_dpadambc.audit.estimators import epsilon_clopper_pearson
from tf_dpadambc.audit.estimators import epsilon_gdp
from tf_dpadambc.audit.estimators import epsilon_one_run
from tf_dpadambc.audit.estimators import epsilon_one_run_fdp
from tf_dpadambc.audit.estimators import gdp_delta
from tf_dpadambc.audit.estimators import gdp_epsilon
from tf_dpadambc.audit.estimators import one_run_p_value
