"""Privacy accounting on dp_accounting: events, ε, σ calibration, statements."""
from tf_dpadambc.accounting.callbacks import PrivacyBudget
from tf_dpadambc.accounting.callbacks import PrivacyTensorBoard
from tf_dpadambc.accounting.epsilon import compute_epsilon
from tf_dpadambc.accounting.epsilon import compute_mf_noise_multiplier
from tf_dpadambc.accounting.epsilon import compute_noise_multiplier
from tf_dpadambc.accounting.epsilon import epsilon_of_event
from tf_dpadambc.accounting.events import dp_sgd_event
from tf_dpadambc.accounting.statement import optimizer_privacy_statement
from tf_dpadambc.accounting.statement import privacy_statement
