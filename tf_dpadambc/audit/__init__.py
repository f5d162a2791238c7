"""Empirical privacy auditing: ε lower bounds from canaries.

``estimators`` turns canary scores into an ε lower bound at a stated
confidence; ``canaries`` sends white-box gradient canaries (and black-box
mislabeled inputs) through the library's real private training path; ``cli``
is ``tf-dpadambc audit``. An audit can refute a claimed ε, never prove it.
"""
from tf_dpadambc.audit.canaries import CanaryScores
from tf_dpadambc.audit.canaries import black_box_scores
from tf_dpadambc.audit.canaries import white_box_scores
from tf_dpadambc.audit.estimators import EpsilonLowerBound
from tf_dpadambc.audit.estimators import FDP_FAMILIES
from tf_dpadambc.audit.estimators import epsilon_clopper_pearson
from tf_dpadambc.audit.estimators import epsilon_gdp
from tf_dpadambc.audit.estimators import epsilon_one_run
from tf_dpadambc.audit.estimators import epsilon_one_run_fdp
from tf_dpadambc.audit.estimators import gdp_delta
from tf_dpadambc.audit.estimators import gdp_epsilon
from tf_dpadambc.audit.estimators import one_run_p_value
