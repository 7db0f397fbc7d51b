"""Classify scikit-learn's bundled 8x8 digits with a bidirectional single-gate RNN.

Each image is read as a sequence: its 8 rows are the time steps, each row's 8 pixels the
features. A bidirectional :class:`jax_sgrnn.nn.SingleGateRNN` reads the rows top to bottom and
bottom to top; the final state of each direction (the forward one after the last row, the
backward one after the first) is concatenated and a dense layer gives the 10 class logits.
The data ship with scikit-learn (1797 images), so nothing is downloaded; a stratified quarter
is held out for testing.

``--variable-length`` makes the sequences ragged: each image keeps only its first 4 to 8 rows
(a random number per image), the rest of the batch is zero padding, and the layer gets the
lengths as ``seq_lengths``, so each image is read exactly as if it were alone and unpadded
(the backward direction starts at the image's own last row).

Run ``python examples/classify_digits.py --help`` for the flags. Writes
``digits_log.json`` and ``digits_confusion.png`` to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits
from sklearn.metrics import ConfusionMatrixDisplay, confusion_matrix
from sklearn.model_selection import train_test_split
from tqdm import tqdm

from jax_sgrnn.nn import SingleGateRNN

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)


class DigitRNN(nnx.Module):
    """Bidirectional single-gate RNN over image rows, then a dense readout of both final states."""

    def __init__(self, hidden_size: int, *, activation: str, impl: str, rngs: nnx.Rngs):
        self.rnn = SingleGateRNN(8, hidden_size, bidirectional=True, activation=activation,
                                 impl=impl, rngs=rngs)
        self.readout = nnx.Linear(2 * hidden_size, 10, rngs=rngs)

    def __call__(self, images: jax.Array, lengths: jax.Array) -> jax.Array:
        """``images`` ``[N, 8, 8]`` (rows as time steps), each ``lengths[n]`` rows long ->
        logits ``[N, 10]``."""
        # [N, 2H]: forward after the image's last row, backward after its first.
        _, final = self.rnn(images, seq_lengths=lengths, return_state=True)
        return self.readout(final)


def cross_entropy(model: DigitRNN, images: jax.Array, lengths: jax.Array,
                  labels: jax.Array) -> jax.Array:
    """Mean cross-entropy, in nats."""
    logits = model(images, lengths)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@nnx.jit
def train_step(model: DigitRNN, optimizer: nnx.Optimizer, images: jax.Array,
               lengths: jax.Array, labels: jax.Array) -> jax.Array:
    """One Adam step; the gradient is the op's gradient op. Returns the loss."""
    loss, grads = nnx.value_and_grad(cross_entropy)(model, images, lengths, labels)
    optimizer.update(model, grads)
    return loss


@nnx.jit
def predict(model: DigitRNN, images: jax.Array, lengths: jax.Array) -> jax.Array:
    """Predicted classes, ``[N]``."""
    return model(images, lengths).argmax(-1)


def plot_confusion(matrix: np.ndarray, accuracy: float, impl: str, path: pathlib.Path) -> None:
    """The test set's confusion matrix (rows: true digit, columns: predicted digit)."""
    fig, ax = plt.subplots(figsize=(5.2, 4.8))
    ConfusionMatrixDisplay(matrix, display_labels=range(10)).plot(ax=ax, colorbar=False,
                                                                 cmap="Blues")
    ax.set_title(f"8x8 digits, bidirectional single-gate RNN\n"
                 f"test accuracy {accuracy:.1%} (impl={impl})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--epochs", type=int, default=40, help="passes over the training set")
    p.add_argument("--batch", type=int, default=64, help="images per batch")
    p.add_argument("--hidden", type=int, default=64, help="hidden size of each direction")
    p.add_argument("--activation", default="tanh",
                   choices=["tanh", "relu", "sigmoid", "hard_sigmoid", "none"],
                   help="RNN activation")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    p.add_argument("--impl", default="op", choices=["op", "reference"],
                   help="'op': the custom call; 'reference': plain lax.scan")
    p.add_argument("--variable-length", action="store_true",
                   help="keep only each image's first 4 to 8 rows (random per image), pad, and "
                        "pass the lengths as seq_lengths")
    p.add_argument("--seed", type=int, default=0, help="random seed (init, split, shuffling)")
    p.add_argument("--out-dir", default="runs/digits", help="where the log and plot go")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Trains, evaluates on the test split; writes the JSON log and the confusion matrix."""
    args = parse_args(argv)
    start = time.perf_counter()
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)  # [1797, 8, 8], pixels in [0, 1]
    rows = np.full(len(images), 8, np.int32)
    if args.variable_length:
        rows = np.random.default_rng(args.seed + 1).integers(4, 9, len(images)).astype(np.int32)
        images[np.arange(8)[None, :] >= rows[:, None]] = 0.0  # padding: never read
    x_train, x_test, l_train, l_test, y_train, y_test = train_test_split(
        images, rows, digits.target, test_size=0.25, stratify=digits.target,
        random_state=args.seed)

    model = DigitRNN(args.hidden, activation=args.activation, impl=args.impl,
                     rngs=nnx.Rngs(args.seed))
    optimizer = nnx.Optimizer(model, optax.adam(args.lr), wrt=nnx.Param)
    rng = np.random.default_rng(args.seed)
    log = {"config": vars(args), "platform": jax.default_backend(),
           "jax_version": jax.__version__, "train_size": len(x_train),
           "test_size": len(x_test), "losses": [], "epoch_losses": []}
    print(f"digits: {len(x_train)} training and {len(x_test)} test images"
          f"{' of 4 to 8 rows' if args.variable_length else ''}; impl={args.impl} on "
          f"{jax.default_backend()}")

    batches = len(x_train) // args.batch  # the remainder is dropped: one shape, one compile
    bar = tqdm(range(1, args.epochs + 1), desc=f"train ({args.impl})", disable=args.quiet,
               unit="epoch")
    for _ in bar:
        order = rng.permutation(len(x_train))[:batches * args.batch].reshape(batches, -1)
        losses = [float(train_step(model, optimizer, x_train[i], l_train[i], y_train[i]))
                  for i in order]
        log["losses"] += losses
        log["epoch_losses"].append(float(np.mean(losses)))
        bar.set_postfix(loss=f"{log['epoch_losses'][-1]:.4f}")

    predicted = np.asarray(predict(model, jnp.asarray(x_test), jnp.asarray(l_test)))
    matrix = confusion_matrix(y_test, predicted, labels=range(10))
    log["test_accuracy"] = float((predicted == y_test).mean())
    log["confusion_matrix"] = matrix.tolist()
    log["wall_time_s"] = time.perf_counter() - start

    (out_dir / "digits_log.json").write_text(json.dumps(log, indent=1))
    plot_confusion(matrix, log["test_accuracy"], args.impl, out_dir / "digits_confusion.png")
    print(f"final training loss {log['epoch_losses'][-1]:.4f}; test accuracy "
          f"{log['test_accuracy']:.2%} ({int((predicted == y_test).sum())}/{len(y_test)}); "
          f"wall time {log['wall_time_s']:.1f} s")
    print("confusion matrix (rows: true digit, columns: predicted):")
    print(matrix)
    print(f"wrote {out_dir / 'digits_log.json'} and {out_dir / 'digits_confusion.png'}")
    return log


if __name__ == "__main__":
    main()
