"""Quickstart: private training with bias-corrected DP-Adam (runs offline)."""
import keras
from sklearn.datasets import load_digits

import tf_dpadambc

# scikit-learn's bundled 8x8 digits: 1,797 examples, 64 features, 10 classes.
x, y = load_digits(return_X_y=True)
x = (x / 16.0).astype("float32")
x_train, y_train, x_test, y_test = x[:1500], y[:1500], x[1500:], y[1500:]

# model.fit shuffles fixed-size batches: account for that ("shuffle"), not
# for Poisson sampling, whose smaller ε model.fit does not deliver.
batch_size, epochs, delta = 150, 15, 1e-5
noise_multiplier = tf_dpadambc.compute_noise_multiplier(
    num_examples=len(x_train), batch_size=batch_size, epochs=epochs,
    target_epsilon=8.0, delta=delta, sampling="shuffle")

model = keras.Sequential([
    keras.Input((64,)),
    keras.layers.Dense(64, activation="tanh"),
    keras.layers.Dense(10),
])
model = tf_dpadambc.make_private(model)  # per-example clipping in train_step
model.compile(
    optimizer=tf_dpadambc.DPAdamBC(
        l2_norm_clip=1.0, noise_multiplier=noise_multiplier,
        learning_rate=2e-3, gamma_prime=1e-6),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    metrics=["accuracy"],
    jit_compile=True)
model.fit(x_train, y_train, batch_size=batch_size, epochs=epochs,
          validation_data=(x_test, y_test),
          callbacks=[tf_dpadambc.PrivacyBudget(len(x_train), delta,
                                               sampling="shuffle")])

_, accuracy = model.evaluate(x_test, y_test, verbose=0)
print(f"Test accuracy: {accuracy:.3f}")
print(tf_dpadambc.optimizer_privacy_statement(
    model.optimizer, num_examples=len(x_train), delta=delta))
