"""DP-MF: DPAdamBC with banded correlated noise vs independent noise (offline).

Both runs reach the same ε with the same data order (the same batches every
epoch, tf_dpadambc.data.cyclic_batches). Independent noise composes one
Gaussian mechanism per epoch; the correlated run is one Gaussian mechanism
in all, its noise calibrated to the strategy's sensitivity over the 10
participations, and part of it cancels across steps.
"""
import keras
from sklearn.datasets import load_digits

import tf_dpadambc
from tf_dpadambc import mf

x, y = load_digits(return_X_y=True)
x = (x / 16.0).astype("float32")
x_train, y_train, x_test, y_test = x[:1500], y[:1500], x[1500:], y[1500:]
batch_size, epochs, delta, target_epsilon = 100, 10, 1e-5, 4.0
steps_per_epoch = tf_dpadambc.data.steps_per_epoch(len(x_train), batch_size)

# BandMF optimized for this run: 150 steps, 10 participations 15 steps apart
# (bands ≤ separation, so the participations' columns never overlap).
strategy = mf.optimize_banded(n=epochs * steps_per_epoch, bands=8,
                              participations=epochs,
                              min_separation=steps_per_epoch)
correlated = tf_dpadambc.CorrelatedNoise.for_cyclic_training(
    strategy, len(x_train), batch_size, epochs)

sigmas = {
    "independent": tf_dpadambc.compute_noise_multiplier(
        len(x_train), batch_size, epochs, target_epsilon, delta,
        sampling="shuffle"),
    "banded MF": tf_dpadambc.compute_mf_noise_multiplier(target_epsilon,
                                                         delta),
}
for name, noise in (("independent", tf_dpadambc.IndependentNoise()),
                    ("banded MF", correlated)):
  keras.utils.set_random_seed(0)
  model = tf_dpadambc.make_private(keras.Sequential([
      keras.Input((64,)),
      keras.layers.Dense(64, activation="tanh"),
      keras.layers.Dense(10),
  ]))
  model.compile(
      optimizer=tf_dpadambc.DPAdamBC(1.0, sigmas[name], 2e-3,
                                     gamma_prime=1e-6, noise=noise),
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      metrics=["accuracy"], jit_compile=True)
  model.fit(tf_dpadambc.data.cyclic_batches(x_train, y_train, batch_size,
                                            seed=0),
            epochs=epochs, shuffle=False, verbose=0)
  _, accuracy = model.evaluate(x_test, y_test, verbose=0)
  epsilon = tf_dpadambc.epsilon_of_event(
      model.optimizer.dp_event(len(x_train), sampling="cyclic"), delta)
  print(f"{name}: σ = {sigmas[name]:.3f}, test accuracy {accuracy:.3f}, "
        f"ε = {epsilon:.2f} (cyclic batches, δ = {delta:g})")

print(tf_dpadambc.optimizer_privacy_statement(
    model.optimizer, num_examples=len(x_train), delta=delta))
