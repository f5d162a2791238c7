"""Argument checks shared by the optimizers, the theory and the advisor."""
import math
import numbers


def check_positive(name, value, allow_zero=False):
  """``value`` as a float if finite and > 0 (≥ 0: allow_zero), else ValueError."""
  if (not isinstance(value, numbers.Real) or isinstance(value, bool)
      or not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero)):
    bound = "≥ 0" if allow_zero else "> 0"
    raise ValueError(f"{name} must be a finite number {bound}; got {value!r}.")
  return float(value)


def check_count(name, value, allow_none=True):
  """An integer ≥ 1 (or None where allowed), else ValueError."""
  if value is None and allow_none:
    return None
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
    either = "None or " if allow_none else ""
    raise ValueError(f"{name} must be {either}an integer ≥ 1; got {value!r}.")
  return int(value)


def check_decay(name, value):
  """An EMA decay β in [0, 1) as a float, else ValueError."""
  if (isinstance(value, bool) or not isinstance(value, numbers.Real)
      or not 0.0 <= float(value) < 1.0):
    raise ValueError(f"{name} must be in [0, 1); got {value!r}.")
  return float(value)
