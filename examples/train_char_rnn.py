"""Character-level language model on Python's own help text, with a stacked single-gate RNN.

The corpus is ``pydoc_data.topics`` (the text behind ``help("assert")`` and friends), which
ships with every CPython: about 465 KB of English and about 100 distinct characters, so the
example needs no download. The model is an embedding, a
:class:`jax_sgrnn.nn.StackedSingleGateRNN` and a dense readout, trained with optax's Adam
(cosine-decayed learning rate, clipped gradients) on random windows of the first 90% of the
text; the last 10% is held out for validation. Losses are reported in bits per character,
next to the text's unigram entropy (what a model that ignores context would reach).

Run ``python examples/train_char_rnn.py --help`` for the flags; ``--impl reference`` runs the
same model on the plain ``lax.scan`` implementation, for comparison; ``--devices K`` trains
data-parallel on K local devices (each batch split over them, the parameters replicated; see
``docs/scaling.md``). Writes ``char_rnn_log.json`` and ``char_rnn_loss.png`` to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import platform
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm import tqdm

from jax_sgrnn.nn import StackedSingleGateRNN

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

LN2 = math.log(2.0)


def load_text() -> str:
    """The help topics of ``pydoc_data.topics``, concatenated in sorted order of their names."""
    from pydoc_data.topics import topics

    return "".join(topics[name] for name in sorted(topics))


def unigram_entropy_bits(ids: np.ndarray, vocab_size: int) -> float:
    """Entropy of the character frequencies in ``ids``, in bits per character."""
    p = np.bincount(ids, minlength=vocab_size) / len(ids)
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


class CharRNN(nnx.Module):
    """Embedding -> stacked single-gate RNN -> dense readout to next-character logits."""

    def __init__(self, vocab_size: int, embed_size: int, hidden_size: int, num_layers: int, *,
                 activation: str, dropout: float, impl: str, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab_size, embed_size, rngs=rngs)
        self.rnn = StackedSingleGateRNN(embed_size, hidden_size, num_layers,
                                        activation=activation, dropout=dropout, impl=impl,
                                        rngs=rngs)
        self.readout = nnx.Linear(hidden_size, vocab_size, rngs=rngs)

    def __call__(self, tokens: jax.Array, init_state: Optional[jax.Array] = None
                 ) -> tuple[jax.Array, jax.Array]:
        """``tokens`` ``[N, T]`` -> (logits ``[N, T, V]``, final states ``[L, N, H]``)."""
        y, state = self.rnn(self.embed(tokens), init_state, return_state=True)
        return self.readout(y), state


def cross_entropy(model: CharRNN, inputs: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-character cross-entropy, in nats."""
    logits, _ = model(inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@nnx.jit
def train_step(model: CharRNN, optimizer: nnx.Optimizer, inputs: jax.Array,
               targets: jax.Array) -> jax.Array:
    """One Adam step; the gradient is the op's gradient op. Returns the loss."""
    loss, grads = nnx.value_and_grad(cross_entropy)(model, inputs, targets)
    optimizer.update(model, grads)
    return loss


@nnx.jit
def eval_loss(model: CharRNN, inputs: jax.Array, targets: jax.Array) -> jax.Array:
    """Cross-entropy without dropout, in nats."""
    return cross_entropy(nnx.view(model, deterministic=True), inputs, targets)


@nnx.jit
def sample_step(model: CharRNN, tokens: jax.Array, state: Optional[jax.Array], key: jax.Array,
                temperature: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Feeds ``tokens`` ``[N, T]`` from ``state``; samples the character that follows."""
    logits, state = nnx.view(model, deterministic=True)(tokens, state)
    return jax.random.categorical(key, logits[:, -1] / temperature), state


def generate(model: CharRNN, prompt: Sequence[int], length: int, temperature: float,
             key: jax.Array) -> list[int]:
    """Samples ``length`` characters after ``prompt``, one time step (T = 1) at a time."""
    tokens, state, out = jnp.asarray([prompt]), None, []
    for step_key in jax.random.split(key, length):
        token, state = sample_step(model, tokens, state, step_key, temperature)
        out.append(int(token[0]))
        tokens = token[:, None]
    return out


def windows(ids: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-overlapping (input, target) windows covering ``ids``: two ``[n, seq_len]`` arrays."""
    n = (len(ids) - 1) // seq_len
    idx = np.arange(n * seq_len).reshape(n, seq_len)
    return ids[idx], ids[idx + 1]


def data_parallel(devices: int, model: CharRNN, optimizer: nnx.Optimizer) -> NamedSharding:
    """Replicates the model and optimizer state over the first ``devices`` local devices;
    returns the sharding that splits a batch (its leading axis) over them.

    With the batch split, each device runs the RNN's custom calls on its own sequences and the
    weight gradients are summed across devices by one all-reduce (``docs/scaling.md``).
    """
    mesh = Mesh(np.array(jax.local_devices()[:devices]), ("data",))
    state = nnx.state((model, optimizer))
    nnx.update((model, optimizer), jax.device_put(state, NamedSharding(mesh, PartitionSpec())))
    return NamedSharding(mesh, PartitionSpec("data"))


def plot_losses(log: dict, path: pathlib.Path) -> None:
    """Training loss (raw and smoothed), validation loss and the unigram entropy."""
    train = np.asarray(log["train_bits"])
    steps = np.arange(1, len(train) + 1)
    width = max(1, len(train) // 50)
    smooth = np.convolve(train, np.ones(width) / width, mode="valid")
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(steps, train, color="tab:blue", alpha=0.25, lw=0.8)
    ax.plot(steps[width - 1:], smooth, color="tab:blue", label="train")
    ax.plot([v["step"] for v in log["val"]], [v["bits"] for v in log["val"]], "o-",
            color="tab:orange", label="validation")
    ax.axhline(log["unigram_entropy_bits"], color="gray", ls="--", label="unigram entropy")
    cfg = log["config"]
    ax.set(xlabel="step", ylabel="bits per character",
           title=f"char RNN on pydoc topics: {cfg['layers']}x{cfg['hidden']} "
                 f"{cfg['activation']}, impl={cfg['impl']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=4000, help="training steps")
    p.add_argument("--batch", type=int, default=32, help="sequences per batch")
    p.add_argument("--seq-len", type=int, default=64, help="characters per training sequence")
    p.add_argument("--embed", type=int, default=64, help="embedding size")
    p.add_argument("--hidden", type=int, default=256, help="hidden size of each RNN layer")
    p.add_argument("--layers", type=int, default=2, help="number of stacked RNN layers")
    p.add_argument("--activation", default="tanh",
                   choices=["tanh", "relu", "sigmoid", "hard_sigmoid", "none"],
                   help="RNN activation")
    p.add_argument("--dropout", type=float, default=0.2, help="dropout between RNN layers")
    p.add_argument("--lr", type=float, default=3e-3,
                   help="Adam learning rate at the start; cosine-decayed to a tenth of it")
    p.add_argument("--clip", type=float, default=1.0, help="gradient clipping (global norm)")
    p.add_argument("--impl", default="op", choices=["op", "reference"],
                   help="'op': the custom call; 'reference': plain lax.scan")
    p.add_argument("--val-every", type=int, default=250, help="validate every N steps")
    p.add_argument("--sample-length", type=int, default=400,
                   help="characters generated at the end")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature")
    p.add_argument("--prompt", default="The ", help="text the generated sample starts from")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--out-dir", default="runs/char_rnn", help="where the log and plot go")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--devices", type=int, default=1,
                   help="local devices to train on, data-parallel (the batch is split over them)")
    args = p.parse_args(argv)
    available = jax.local_device_count()
    if not 1 <= args.devices <= available:
        p.error(f"--devices {args.devices}: {available} local {jax.default_backend()} device(s) "
                "available (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=K "
                "provides K)")
    if args.batch % args.devices:
        p.error(f"--batch {args.batch} does not split evenly over --devices {args.devices}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Trains, validates, samples; writes the JSON log and the loss plot; returns the log."""
    args = parse_args(argv)
    start = time.perf_counter()
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    text = load_text()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    ids = np.array([index[c] for c in text], dtype=np.int32)
    split = int(0.9 * len(ids))
    train_ids, val_ids = ids[:split], ids[split:]
    val_inputs, val_targets = map(jnp.asarray, windows(val_ids, args.seq_len))
    unigram = unigram_entropy_bits(train_ids, len(chars))
    prompt = [index[c] for c in args.prompt if c in index] or [index[" "]]

    model = CharRNN(len(chars), args.embed, args.hidden, args.layers,
                    activation=args.activation, dropout=args.dropout, impl=args.impl,
                    rngs=nnx.Rngs(args.seed))
    schedule = optax.cosine_decay_schedule(args.lr, args.steps, alpha=0.1)
    optimizer = nnx.Optimizer(
        model, optax.chain(optax.clip_by_global_norm(args.clip), optax.adam(schedule)),
        wrt=nnx.Param)
    batch_sharding = data_parallel(args.devices, model, optimizer)
    rng = np.random.default_rng(args.seed)
    offsets = np.arange(args.seq_len + 1)

    log = {
        "config": vars(args),
        "platform": jax.default_backend(),
        "jax_version": jax.__version__,
        "python_version": platform.python_version(),
        "text_chars": len(text), "vocab_size": len(chars),
        "train_chars": len(train_ids), "val_chars": len(val_ids),
        "unigram_entropy_bits": unigram,
        "train_bits": [], "val": [],
    }
    print(f"text: {len(text):,} characters, {len(chars)} distinct; unigram entropy "
          f"{unigram:.3f} bits/char; impl={args.impl} on {args.devices} "
          f"{jax.default_backend()} device(s)")

    chars_per_step = args.batch * args.seq_len
    bar = tqdm(range(1, args.steps + 1), desc=f"train ({args.impl})", disable=args.quiet,
               unit="step")
    train_time, clock, unread, bits = 0.0, None, None, float("nan")

    def read(loss: jax.Array) -> float:
        """Waits for a step's loss and logs it, in bits per character."""
        bits = float(loss) / LN2
        log["train_bits"].append(bits)
        return bits

    for step in bar:
        batch = train_ids[rng.integers(0, len(train_ids) - args.seq_len - 1, args.batch)[:, None]
                          + offsets]
        inputs, targets = jax.device_put((batch[:, :-1], batch[:, 1:]), batch_sharding)
        loss = train_step(model, optimizer, inputs, targets)
        # The previous step's loss is read only now, with this step queued behind it, so the
        # host samples and sends the next batch while the devices work.
        if unread is not None:
            bits = read(unread)
        unread = loss
        validate = step % args.val_every == 0 or step == args.steps
        if step == 1 or validate:  # the model must be this step's: wait for it
            bits, unread = read(unread), None
            if step == 1:  # which compiles: not timed
                clock = time.perf_counter()
        postfix = {"bits/char": f"{bits:.3f}"}
        if step > 1:
            elapsed = train_time + time.perf_counter() - clock
            postfix["chars/s"] = f"{chars_per_step * (step - 1) / elapsed:,.0f}"
        if validate:
            train_time += time.perf_counter() - clock
            val_bits = float(eval_loss(model, val_inputs, val_targets)) / LN2
            log["val"].append({"step": step, "bits": val_bits})
            bar.write(f"step {step}: train {bits:.3f}, validation {val_bits:.3f} bits/char")
            clock = time.perf_counter()
        if log["val"]:
            postfix["val"] = f"{log['val'][-1]['bits']:.3f}"
        bar.set_postfix(postfix)

    tail = log["train_bits"][-max(10, args.steps // 20):]
    log["final_train_bits"] = float(np.mean(tail))
    log["final_val_bits"] = log["val"][-1]["bits"]
    log["chars_per_sec"] = (chars_per_step * (args.steps - 1) / train_time
                            if train_time > 0 else None)
    sample = generate(model, prompt, args.sample_length, args.temperature,
                      jax.random.key(args.seed))
    log["sample"] = "".join(chars[i] for i in prompt + sample)
    log["wall_time_s"] = time.perf_counter() - start

    (out_dir / "char_rnn_log.json").write_text(json.dumps(log, indent=1))
    plot_losses(log, out_dir / "char_rnn_loss.png")
    print(f"\nunigram entropy {unigram:.3f} bits/char; final train {log['final_train_bits']:.3f} "
          f"(mean of the last {len(tail)} steps), validation {log['final_val_bits']:.3f} "
          f"bits/char")
    if log["chars_per_sec"]:
        print(f"{log['chars_per_sec']:,.0f} characters/s in training; "
              f"wall time {log['wall_time_s']:.1f} s")
    print(f"\nsample (temperature {args.temperature}):\n{log['sample']}\n")
    print(f"wrote {out_dir / 'char_rnn_log.json'} and {out_dir / 'char_rnn_loss.png'}")
    return log


if __name__ == "__main__":
    main()
