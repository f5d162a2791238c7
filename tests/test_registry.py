"""The ghost-rule registry: user rules, exact-type lookup, and the privacy
bound holding whatever a user rule computes."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dpadambc as dp
from tf_dpadambc.core import clipping
from tf_dpadambc.keras.rules import registry

from tests.test_ghost import assert_same, ghost_sum, reference, _data


class Scale(keras.layers.Layer):
  """y = x ⊙ w (w: [d]) on [..., d]."""

  def build(self, input_shape):
    self.w = self.add_weight(shape=input_shape[-1:], initializer="ones")

  def call(self, inputs):
    return inputs * self.w


class ScaleRule(dp.GhostRule):
  """∇w_u = Σ_t δ_t ⊙ x_t, as a linear term: positions t·d, a = x, one-hot
  features... simpler: the gradient itself."""

  def unit_terms(self, calls, context):
    grads = [tf.reduce_sum(tf.reshape(c.delta * c.inputs,
                                      [-1, c.inputs.shape[-1]]), 0)
             for c in calls]
    return [[dp.gradient_term(g) for g in grads]]

  def plan(self):
    return "user rule: Σ δ⊙x"


class Bilinear(keras.layers.Layer):
  """y = x K (a Dense without bias), for a linear_term rule."""

  def build(self, input_shape):
    self.k = self.add_weight(shape=(input_shape[-1], 4))

  def call(self, inputs):
    return tf.matmul(inputs, self.k)


class BilinearRule(dp.GhostRule):

  def unit_terms(self, calls, context):
    return [[dp.linear_term(tf.reshape(c.inputs, [-1, c.inputs.shape[-1]]),
                            tf.reshape(c.delta, [-1, 4])) for c in calls]]


dp.register_ghost_rule(Scale, ScaleRule)
dp.register_ghost_rule(Bilinear, BilinearRule)


def _model(first):
  return keras.Sequential([keras.Input((3, 7)), first,
                           keras.layers.Dense(4, activation="tanh"),
                           keras.layers.Flatten(), keras.layers.Dense(3)])


@pytest.mark.parametrize("layer,microbatches", [
    (Scale, None), (Scale, 2), (Bilinear, None), (Bilinear, 4)])
def test_registered_user_rules_are_exact(layer, microbatches):
  rng = np.random.default_rng(0)
  model = _model(layer())
  for v in model.layers[0].weights:
    v.assign(rng.uniform(0.5, 1.5, v.shape).astype("float32"))
  x, y = _data(model, rng)
  spec = clipping.ClipSpec(0.3, square_sum=True)
  assert_same(ghost_sum(model, x, y, None, spec, microbatches),
              reference(model, x, y, None, spec, microbatches))
  plan = dp.clipping_plan(model)
  assert not plan.per_layer_fallbacks and plan.fallback is None, plan
  assert any(e.kind == layer.__name__ and e.method.startswith("user rule")
             for e in plan.entries), plan


class ScaleSubclass(Scale):
  """Changes call: must not inherit ScaleRule (exact type by default)."""

  def call(self, inputs):
    return tf.tanh(inputs) * self.w


def test_subclasses_do_not_inherit_a_rule_unless_registered():
  assert registry.lookup(ScaleSubclass()) is None
  rng = np.random.default_rng(1)
  model = _model(ScaleSubclass())
  x, y = _data(model, rng)
  spec = clipping.ClipSpec(0.3)
  assert_same(ghost_sum(model, x, y, None, spec, None),
              reference(model, x, y, None, spec, None))
  assert [e.kind for e in dp.clipping_plan(model).per_layer_fallbacks] == [
      "ScaleSubclass"]
  # exact_type=False on a parent covers subclasses
  class Parent(keras.layers.Layer):
    pass

  class Child(Parent):
    pass
  dp.register_ghost_rule(Parent, ScaleRule, exact_type=False)
  assert registry.lookup(Child()) is not None


def test_built_in_rules_are_in_the_registry():
  for layer in (keras.layers.Dense(2), keras.layers.EinsumDense("ab,bc->ac", 2),
                keras.layers.Embedding(3, 2), keras.layers.LayerNormalization(),
                keras.layers.ReversibleEmbedding(3, 2),
                keras.layers.RMSNormalization()):
    assert registry.lookup(layer) is not None, layer
  assert registry.lookup(keras.layers.Layer()) is None


def test_a_wrong_user_rule_still_adds_at_most_c_per_unit():
  """The library forms a unit's norm and its share of the sum from the same
  rule values, per unit: a wrong rule cannot make a unit add more than C
  (nor put its data in another unit's row). Measured: the released sum
  (σ = 0) moves by ≤ C when one example is removed, ≤ 2C when replaced."""
  from tests import test_adversarial as adv  # pylint: disable=import-outside-toplevel
  model = adv.build("user_rule_fold", False)
  removed, replaced, removal = adv.measure(model, "plain",
                                           np.random.default_rng(0))
  assert removed <= removal * adv.TOL and replaced <= 2 * adv.C * adv.TOL
  # and the rule was used (its gradient is wrong, not the bound)
  assert "WrongScaleRule" in str(dp.clipping_plan(model))


def test_a_rule_must_cover_exactly_the_layers_weights():
  class Partial(dp.GhostRule):
    @property
    def variables(self):
      return []

  class Two(keras.layers.Layer):
    def build(self, shape):
      self.w = self.add_weight(shape=shape[-1:])

    def call(self, x):
      return x * self.w
  dp.register_ghost_rule(Two, Partial)
  model = _model(Two())
  x, y = _data(model, np.random.default_rng(2))
  with pytest.raises(ValueError, match="exactly the trainable weights"):
    ghost_sum(model, x, y, None, clipping.ClipSpec(1.0), None)
