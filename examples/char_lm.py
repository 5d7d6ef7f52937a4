"""A character-level language model trained with DiLoCo, in your own loop.

    shoal run --workers 2 examples/char_lm.py                   # DiLoCo: workers meet every --tau steps
    shoal run --workers 2 examples/char_lm.py --strategy sync   # gradients averaged every step
    torchrun --nproc-per-node 2 examples/char_lm.py             # the same, under torchrun
    python examples/char_lm.py                                  # one process

The text is the Python reference manual's help topics, which ship with Python itself
(``pydoc_data.topics``, about 465k characters): nothing to download. The model is a small
causal transformer. With DiLoCo (Douillard et al. 2023) every worker takes --tau AdamW steps
from the global model, then the workers average how far they moved (one message) and the
global model takes an outer Nesterov step along it (lr 0.7, momentum 0.9, as in the paper).
Rank 0 prints the validation bits per character of the global model (``strategy.eval_module``)
as it trains, and at the end a sample from it.
"""

import argparse
import json
import math
import time
from pydoc_data.topics import topics

import torch
import torch.nn.functional as F
from torch import nn

import shoal
from shoal.core.ops import values_by_rank

parser = argparse.ArgumentParser(description="a character-level language model, data-parallel")
parser.add_argument("--strategy", default="diloco", help="diloco, sync, local-sgd or easgd")
parser.add_argument("--steps", type=int, default=800, help="training steps on every worker")
parser.add_argument("--tau", type=int, default=50, help="local steps between two exchanges")
parser.add_argument("--batch-size", type=int, default=32, help="windows per worker and step")
parser.add_argument("--context", type=int, default=64, help="characters the model sees")
parser.add_argument("--width", type=int, default=64, help="the transformer's width (4 heads)")
parser.add_argument("--layers", type=int, default=2, help="transformer layers")
parser.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate")
parser.add_argument("--eval-every", type=int, default=100, help="steps between evaluations")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--fragments", type=int, default=1, help="Streaming DiLoCo's fragments")
parser.add_argument("--overlap-steps", type=int, default=0, help="steps an exchange travels behind")
parser.add_argument("--fragment-pattern", default="sequential",
                    help="sequential or strided: which layers form a fragment")
parser.add_argument("--mix-alpha", type=float, default=0.5,
                    help="diloco: a fragment that lands after overlapped steps becomes alpha * local "
                    "+ (1 - alpha) * global")
parser.add_argument("--outer-precision", default="fp32", help="fp32, bf16, fp8, int8 or int4")
parser.add_argument("--measure-wait", action="store_true",
                    help="a barrier before each exchange: a slower worker's lead is booked as wait")
parser.add_argument("--threads", type=int, help="torch threads a worker (default: the node's cores "
                    "divided among its workers; emulated hosts share one machine's cores)")
parser.add_argument("--json", help="rank 0 writes its numbers here at the end (benchmarks)")
args = parser.parse_args(None if __name__ == "__main__" else [])  # importable: benchmarks/bench_torchft.py

text = "".join(topics[name] for name in sorted(topics))  # sorted: the same text everywhere
chars = sorted(set(text))
code = {c: i for i, c in enumerate(chars)}
tokens = torch.tensor([code[c] for c in text])
split = int(0.9 * len(tokens))  # the last 10% is held out


class Windows:
    """Window ``i``: the ``context`` characters from ``i`` on, and the same shifted by one.

    ``strategy.batches`` takes anything with ``len`` and ``get_batch(idx)``; indexing the text
    with an offset grid makes a batch without ever storing the ~420k overlapping windows.
    """

    def __init__(self, tokens: torch.Tensor, context: int) -> None:
        self.tokens, self.offsets = tokens, torch.arange(context)

    def __len__(self) -> int:
        return len(self.tokens) - len(self.offsets)

    def get_batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = idx[:, None] + self.offsets
        return self.tokens[rows], self.tokens[rows + 1]


class CharTransformer(nn.Module):
    """A small causal transformer: the logits at position ``t`` see characters ``0..t`` only."""

    def __init__(self, vocab: int, context: int, width: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(context, width)
        # No dropout (a short run does not overfit 420k characters), so train and eval mode agree.
        block = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        # Made here rather than kept as a buffer: DDP (sync) would broadcast a buffer every step.
        mask = nn.Transformer.generate_square_subsequent_mask(n)
        h = self.embed(x) + self.position(torch.arange(n))
        return self.head(self.norm(self.blocks(h, mask=mask, is_causal=True)))


@torch.no_grad()
def bits_per_char(model: nn.Module, data: Windows) -> float:
    x, y = data.get_batch(torch.arange(0, len(data), args.context))  # every character once
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item() / math.log(2)


@torch.no_grad()
def sample(model: nn.Module, prompt: str, length: int) -> str:
    generator = torch.Generator().manual_seed(args.seed)  # the same sample on every run
    out = torch.tensor([[code[c] for c in prompt]])
    for _ in range(length):
        logits = model(out[:, -args.context:])[0, -1]
        out = torch.cat([out, torch.multinomial(logits.softmax(-1), 1, generator=generator)[None]], 1)
    return "".join(chars[i] for i in out[0, len(prompt):].tolist())


def main() -> tuple[shoal.Strategy, list[tuple[int, float]]]:
    """Train with shoal's strategy, print the validation bits/char and a sample; returns the
    strategy and the validation history."""
    train, val = Windows(tokens[:split], args.context), Windows(tokens[split:], args.context)
    torch.manual_seed(args.seed)  # every worker starts from the same weights
    model = CharTransformer(len(chars), args.context, args.width, args.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)  # DiLoCo's inner optimizer
    streaming = {"fragments": args.fragments, "overlap_steps": args.overlap_steps,
                 "fragment_pattern": args.fragment_pattern,
                 "outer_precision": args.outer_precision, "measure_wait": args.measure_wait}
    shoal.init(threads=args.threads)  # joins the job; the strategy uses it
    if args.strategy == "diloco":
        strategy = shoal.strategy("diloco", model, optimizer, tau=args.tau, outer_lr=0.7, outer_momentum=0.9,
                                  mix_alpha=args.mix_alpha, **streaming)
    elif args.strategy == "sync":
        strategy = shoal.strategy("sync", model, optimizer)
    else:
        strategy = shoal.strategy(args.strategy, model, optimizer, tau=args.tau, **streaming)
    rank, workers = strategy.comm.rank, strategy.comm.world_size

    history: list[tuple[int, float]] = []  # (step, validation bits/char of the global model)
    step, epoch, start = 0, 0, time.perf_counter()
    sent_at_start, timeline = strategy.comm.bytes_sent, strategy.comm.timeline
    at_start = dict(timeline.totals)  # the start's broadcast is not training
    evaluating = 0.0  # seconds spent on validation, not training
    while step < args.steps:  # an epoch (~6.5k steps on 2 workers) is longer than a usual run
        for x, y in strategy.batches(train, batch_size=args.batch_size, epoch=epoch, seed=args.seed):
            loss = F.cross_entropy(strategy.module(x).flatten(0, 1), y.flatten())
            strategy.backward(loss)
            strategy.step()
            strategy.zero_grad()
            step += 1
            if step % args.eval_every == 0 or step == args.steps:
                # DiLoCo's global model holds the rounds closed so far (all of them when tau divides step).
                evaluated = time.perf_counter()
                history.append((step, bits_per_char(strategy.eval_module, val)))
                evaluating += time.perf_counter() - evaluated
                if rank == 0:
                    print(f"step {step:5d}  val {history[-1][1]:.3f} bits/char  "
                          f"{time.perf_counter() - start:5.1f} s", flush=True)
            if step == args.steps:
                break
        epoch += 1

    seconds, bpc = time.perf_counter() - start, history[-1][1]
    # Every worker's training seconds (evaluation left out), and of them the seconds its loop was
    # blocked on its exchanges (launching one, waiting for one in flight: exposed communication)
    # and, with --measure-wait, waiting for a slower worker before an exchange.
    own = [seconds - evaluating] + [timeline.totals.get(k, 0.0) - at_start.get(k, 0.0)
                                    for k in ("comm", "wait")]
    ranks = values_by_rank(strategy.comm, own)
    if rank == 0 and args.json:
        train_s = own[0]
        with open(args.json, "w") as f:
            f.write(json.dumps({"bits_per_char": bpc, "steps": step, "train_s": train_s,
                                "samples_per_s": step * args.batch_size * workers / train_s,
                                "comm_s": own[1], "parameters": sum(p.numel() for p in model.parameters()),
                                "exposed_comm_by_rank": [c / t for t, c, _ in ranks],
                                "wait_by_rank": [w / t for t, _, w in ranks],
                                "bytes_sent": strategy.comm.bytes_sent - sent_at_start,
                                "peak_bytes_in_flight": strategy.comm.peak_in_flight}))
    continuation = "The " + sample(strategy.eval_module, "The ", 120)
    if rank == 0:
        print(f"{args.strategy}, {workers} worker{'s' * (workers > 1)}: {bpc:.3f} bits/char after "
              f"{step} steps, "
              f"{seconds:.1f} s, rank 0 sent {strategy.comm.bytes_sent / 1e6:.1f} MB | {continuation!r}")
    return strategy, history


if __name__ == "__main__":
    strategy, history = main()  # globals, as tests/test_char_lm_example.py reads them
