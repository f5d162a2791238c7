"""Cyclic Poisson sampling (data.cyclic_poisson_batches) and the amplified
BandMF ε it earns, verified by the ledger.

Statistical tests state their tolerance in standard errors (SE); with the
fixed seeds used they are deterministic.
"""
import math

import dp_accounting
import keras
import numpy as np
import pytest

import tf_dpadambc as dp
from tf_dpadambc import data
from tf_dpadambc import mf

N, B, G, D, K = 120, 6, 4, 4, 3
P = B * G / N  # 0.2


def _ids_dataset(**kwargs):
  ids = np.arange(N)
  return data.cyclic_poisson_batches(ids.astype("float32")[:, None], ids,
                                     expected_batch_size=B, groups=G,
                                     **kwargs)


def test_groups_are_a_partition_and_steps_only_visit_their_group():
  ds = _ids_dataset(seed=5)
  info = ds.cyclic_poisson
  assert info.groups == G and info.probability == pytest.approx(P)
  assert info.steps_per_epoch % G == 0
  members = np.concatenate(info.partition)
  assert sorted(members.tolist()) == list(range(N))  # disjoint and covering
  assert {len(m) for m in info.partition} == {N // G}
  group = np.empty(N, int)
  for g, m in enumerate(info.partition):
    group[m] = g
  epochs = 60
  steps = info.steps_per_epoch
  inc = np.zeros((epochs * steps, N))
  for e in range(epochs):
    for j, (_, y, w) in enumerate(ds.as_numpy_iterator()):
      real = y[w > 0]
      assert len(set(real)) == len(real)
      inc[e * steps + j, real] = 1
  t = np.arange(len(inc))
  # An example appears only in steps t ≡ its group (mod b).
  for i in range(N):
    assert set(t[inc[:, i] > 0] % G) <= {group[i]}
  # Per group: inclusion frequency p at its visits, within 5 SE.
  for g in range(G):
    visits = inc[t % G == g][:, info.partition[g]]
    se = math.sqrt(P * (1 - P) / visits.size)
    assert abs(visits.mean() - P) < 5 * se, (g, visits.mean())
    # Every example of the group, not just the group on average: its count
    # over V visits is Binomial(V, p); all 30 within 5 SE.
    v = len(visits)
    counts = visits.sum(axis=0)
    assert np.all(np.abs(counts - v * P) < 5 * math.sqrt(v * P * (1 - P)))
  # Fresh at every visit: inclusions at consecutive visits of a group are
  # uncorrelated (|r| < 5/√n).
  g0 = inc[t % G == 0][:, info.partition[0]]
  a, b = g0[:-1].ravel(), g0[1:].ravel()
  assert abs(np.corrcoef(a, b)[0, 1]) < 5 / math.sqrt(a.size)


def test_bad_configurations_are_refused():
  x = np.zeros((N, 1), "float32")
  with pytest.raises(ValueError, match="p = B·b/N"):
    data.cyclic_poisson_batches(x, expected_batch_size=40, groups=4)
  with pytest.raises(ValueError, match="multiple of groups"):
    data.cyclic_poisson_batches(x, expected_batch_size=B, groups=G,
                                steps_per_epoch=6)
  with pytest.raises(ValueError, match="exceeds N"):
    data.cyclic_poisson_batches(x[:3], expected_batch_size=1, groups=4)
  with pytest.raises(ValueError, match="expected_batch_size"):
    data.cyclic_poisson_batches(x, expected_batch_size=0, groups=G)


def _problem():
  rng = np.random.default_rng(0)
  return (rng.normal(size=(N, D)).astype("float32"),
          rng.integers(0, K, size=N).astype("int32"))


def _model(noise, sigma=1.3, **kwargs):
  keras.utils.set_random_seed(3)
  model = dp.make_private(keras.Sequential([
      keras.Input((D,)), keras.layers.Dense(8, activation="tanh"),
      keras.layers.Dense(K)]))
  opt = dp.DPAdamBC(1.0, sigma, learning_rate=1e-2, expected_batch_size=B,
                    noise=noise, **kwargs)
  model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
      from_logits=True))
  return model, opt


def _banded(steps):
  return dp.CorrelatedNoise(mf.Toeplitz([1.0, 0.5, 0.25]), steps=steps)


def _own_epsilon(sigma_eff, p, compositions, delta):
  """dp-accounting's own computation, built here from Theorem 4's terms."""
  accountant = dp_accounting.rdp.RdpAccountant()
  accountant.compose(dp_accounting.PoissonSampledDpEvent(
      p, dp_accounting.GaussianDpEvent(sigma_eff)), compositions)
  return accountant.get_epsilon(delta)


def test_fit_on_cyclic_poisson_reports_the_amplified_epsilon_as_real():
  x, y = _problem()
  epochs, delta, sigma = 2, 1e-5, 1.3
  ds = data.cyclic_poisson_batches(x, y, expected_batch_size=B, groups=G)
  steps = epochs * ds.cyclic_poisson.steps_per_epoch  # 40
  noise = _banded(steps)
  model, opt = _model(noise, sigma)
  budget = dp.PrivacyBudget(N, delta, verbose=0)
  model.fit(ds, epochs=epochs, verbose=0, callbacks=[budget])
  assert opt.steps_taken == steps
  assert budget.run_sampling == "cyclic_poisson"
  # σ as Theorem 4 needs it: columns of norm 1 (ours: ‖c‖), the noise
  # calibrated to sens(C).
  column = np.linalg.norm([1.0, 0.5, 0.25])
  sigma_eff = sigma * noise.sensitivity / column
  want = _own_epsilon(sigma_eff, P, math.ceil(steps / G), delta)
  event = opt.dp_event(N)
  assert event.count == steps // G
  assert event.event.sampling_probability == pytest.approx(P)
  assert event.event.event.noise_multiplier == pytest.approx(sigma_eff)
  assert budget.history[-1] == pytest.approx(want, rel=1e-9)
  text = dp.optimizer_privacy_statement(opt, N, delta)
  assert f"ε = {want:.3f} with cyclic Poisson sampling: the guarantee" in text
  assert "verified" in text and "GIVEN" not in text
  assert "IF the batches" not in text and "NO ε" not in text
  # Amplification is worth it here: the unamplified single-Gaussian figure
  # for one participation per epoch is larger.
  assert want < dp_accounting.rdp.RdpAccountant().compose(
      noise.accounting_event(sigma, steps, "cyclic", B, N)).get_epsilon(delta)


def test_the_amplified_epsilon_is_refused_unless_every_batch_was_verified():
  x, y = _problem()
  steps = 2 * 20
  # (a) Plain Poisson batches: no ε holds for banded MF; the statement says
  # why and gives the figure only as what verified batches would earn.
  model, opt = _model(_banded(steps))
  model.fit(data.poisson_batches(x, y, expected_batch_size=B, seed=1),
            epochs=1, verbose=0)
  with pytest.raises(ValueError, match="none of its batches was verified"):
    opt.dp_event(N)
  text = dp.optimizer_privacy_statement(opt, N, 1e-5)
  assert "NO ε holds" in text and "would hold" in text
  # (b) A verified epoch, then an epoch of other data: not every batch.
  model, opt = _model(_banded(steps))
  model.fit(data.cyclic_poisson_batches(x, y, expected_batch_size=B,
                                        groups=G, seed=2), epochs=1, verbose=0)
  assert opt.dp_event(N).count == 5
  model.fit(data.poisson_batches(x, y, expected_batch_size=B, seed=3),
            epochs=1, verbose=0)
  with pytest.raises(ValueError, match="only 20 of its 40 batches"):
    opt.dp_event(N)
  # (c) An epoch that starts at a step ≢ 0 (mod b): broken.
  model, opt = _model(_banded(steps))
  model.fit(data.poisson_batches(x, y, expected_batch_size=B, seed=4,
                                 steps_per_epoch=3), epochs=1, verbose=0)
  model.fit(data.cyclic_poisson_batches(x, y, expected_batch_size=B,
                                        groups=G, seed=5), epochs=1, verbose=0)
  with pytest.raises(ValueError, match="did not take group t mod b"):
    opt.dp_event(N)
  # (d) Two fits on samplers of another partition (partition_seed): an
  # example can be in the groups of two adjacent steps (a review: examples
  # 2, 16 and 21 at steps 19 and 20, the run taken for verified).
  model, opt = _model(_banded(steps))
  for partition_seed in (0, 1):
    model.fit(data.cyclic_poisson_batches(
        x, y, expected_batch_size=B, groups=G, partition_seed=partition_seed),
              epochs=1, verbose=0)
  with pytest.raises(ValueError, match="did not take group t mod b"):
    opt.dp_event(N)
  model, opt = _model(_banded(steps))  # the same partition twice: verified
  for _ in range(2):
    model.fit(data.cyclic_poisson_batches(
        x, y, expected_batch_size=B, groups=G, partition_seed=0),
              epochs=1, verbose=0)
  assert opt.dp_event(N).count == 10
  # (e) A fixed sampling seed is said in the statement.
  model, opt = _model(_banded(steps))
  model.fit(data.cyclic_poisson_batches(x, y, expected_batch_size=B,
                                        groups=G, seed=6), epochs=1, verbose=0)
  assert "GIVEN" in dp.optimizer_privacy_statement(opt, N, 1e-5)


def test_misuse_is_refused_before_the_first_step():
  x, y = _problem()
  ds = data.cyclic_poisson_batches(x, y, expected_batch_size=B, groups=G)
  # Independent noise would be accounted as plain Poisson (q = B/N every
  # step): an under-statement for b > 1.
  model, opt = _model(None)
  with pytest.raises(ValueError, match="under-state"):
    model.fit(ds, epochs=1, verbose=0)
  assert opt.iterations.numpy() == 0
  # Fewer groups than bands: Theorem 4 does not apply.
  model, opt = _model(_banded(40))
  model.fit(data.cyclic_poisson_batches(x, y, expected_batch_size=B,
                                        groups=2), epochs=1, verbose=0)
  with pytest.raises(ValueError, match="b ≥ the bands"):
    opt.dp_event(N)
  # A strategy that is not banded takes no Poisson batches at all.
  with pytest.raises(ValueError, match="not banded"):
    dp.DPAdamBC(1.0, 1.0, expected_batch_size=B, noise=dp.CorrelatedNoise(
        mf.sqrt_toeplitz(64), steps=40))
