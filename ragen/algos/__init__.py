"""Pure tensor RL algorithms (advantage estimators, losses, filters). torch only: no I/O, no env
or model knowledge. Importing this package registers every estimator and policy loss by name."""

from ragen.algos import advantages, filtering, losses  # noqa: F401  (registers estimators / losses)
from ragen.algos.advantages import AdvantageInputs, AdvantageOutputs
from ragen.algos.core import aggregate_loss, masked_mean, masked_sum, masked_whiten
from ragen.algos.filtering import uncertainty_filter
from ragen.algos.losses import clipped_policy_loss, entropy_loss, kl_penalty, value_loss
from ragen.algos.registry import (
    ADV_ESTIMATORS,
    POLICY_LOSSES,
    get_adv_estimator,
    get_policy_loss,
    register_adv_estimator,
    register_policy_loss,
)

__all__ = [
    "ADV_ESTIMATORS",
    "POLICY_LOSSES",
    "AdvantageInputs",
    "AdvantageOutputs",
    "aggregate_loss",
    "clipped_policy_loss",
    "entropy_loss",
    "get_adv_estimator",
    "get_policy_loss",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "register_adv_estimator",
    "register_policy_loss",
    "uncertainty_filter",
    "value_loss",
]
