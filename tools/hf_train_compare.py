"""Train a small Llama with flashgen's attention and with SDPA; compare loss curves and step times.

Why: issue 19 asks for evidence that a real Hugging Face model trains with
flashgen's attention as it does with PyTorch's SDPA, not only that single
kernels match a reference.  This script builds a Llama-style model from a
config (random weights, nothing is downloaded), trains it for a few steps once
per attention implementation from the same initial weights on the same token
batches, and reports the loss per step, the relative loss difference, and the
median step time.  It exits 1 if the largest relative loss difference exceeds
--tolerance, if the untrained logits differ by more than --logits-tolerance, or
if a registered implementation was not called once per layer.

    python tools/hf_train_compare.py --steps 50 --json hf_train.json
    python tools/hf_train_compare.py --device cpu --impls sdpa,eager --layers 2 \
        --hidden 64 --heads 4 --kv-heads 2 --intermediate 128 --vocab 256 --seq 32 --batch 2 --steps 3

The first implementation in --impls is the reference the others are compared to.
"flashgen" is registered with transformers under --register-name (default
"fg_attention"), not under "flashgen": transformers (5.x) treats every
attn_implementation whose name contains "flash" as a flash-attention kernel to
import, and building the model then fails.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

import torch
import transformers

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--impls", default="sdpa,flashgen", help="comma-separated; the first is the reference")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the median step time")
    p.add_argument("--every", type=int, default=10, help="print the loss of every N-th step")
    p.add_argument("--tolerance", type=float, default=0.01, help="max allowed |l - l_ref| / l_ref")
    p.add_argument("--logits-tolerance", type=float, default=0.05,
                   help="max allowed |z - z_ref| / |z_ref| of the untrained logits (the loss at random init "
                        "hardly depends on attention: it stays near ln(vocab))")
    p.add_argument("--device", default="cuda")
    p.add_argument("--register-name", default="fg_attention",
                   help='name "flashgen" is registered under; transformers takes any name containing "flash" '
                        "for a flash-attention kernel to import, so it must not contain that word")
    p.add_argument("--json", metavar="PATH", help="write all results here")
    return p.parse_args(argv)


def attn_name(args, impl):
    """The attn_implementation string for an impl label: flashgen's is the name it was registered under."""
    return args.register_name if impl == "flashgen" else impl


def make_config(args, impl):
    return transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.seq, 2048), attn_implementation=attn_name(args, impl))


def make_batches(args):
    """Every implementation sees the same tokens, drawn once from a generator of their own."""
    gen = torch.Generator().manual_seed(args.seed)
    return [torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(args.device)
            for _ in range(args.steps)]


def build_model(args, impl, initial_state=None):
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = transformers.LlamaForCausalLM(make_config(args, impl))
    model.to(DTYPES[args.dtype])
    if initial_state is not None:
        model.load_state_dict(initial_state)
    assert model.config._attn_implementation == attn_name(args, impl), model.config._attn_implementation
    return model


def make_optimizer(model, lr):
    try:
        return torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(model.parameters(), lr=lr)


@contextlib.contextmanager
def count_calls(impl):
    """Wrap the function registered under ``impl`` so its calls are counted ("eager" is no entry: None)."""
    registry = transformers.AttentionInterface._global_mapping
    original = registry.get(impl)
    counter = {"calls": None if original is None else 0}
    if original is not None:
        def counted(*a, **kw):
            counter["calls"] += 1
            return original(*a, **kw)
        transformers.AttentionInterface.register(impl, counted)
    try:
        yield counter
    finally:
        if original is not None:
            transformers.AttentionInterface.register(impl, original)


def check_forward(args, impls, initial_state, tokens):
    """One forward per impl, no training: count the attention calls and compare logits with the reference's."""
    logits, report = {}, {}
    for impl in impls:
        model = build_model(args, impl, initial_state).eval()
        with count_calls(attn_name(args, impl)) as counter, torch.no_grad():
            logits[impl] = model(input_ids=tokens).logits.float()
        ref = logits[impls[0]]
        rel = ((logits[impl] - ref).norm() / ref.norm()).item()
        report[impl] = {"attention_calls": counter["calls"], "logits_rel_diff_vs_ref": rel}
        del model
    return report


class StepTimer:
    """CUDA events on a GPU (read once at the end, so no step waits for the host); wall clock on a CPU."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.marks = []

    def start(self):
        self.marks.append([self._mark(), None])

    def stop(self):
        self.marks[-1][1] = self._mark()

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def milliseconds(self):
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in self.marks]
        return [(b - a) * 1e3 for a, b in self.marks]


def train(args, impl, initial_state, batches):
    model = build_model(args, impl, initial_state).train()
    optimizer = make_optimizer(model, args.lr)
    timer, losses = StepTimer(args.device), []
    for tokens in batches:
        timer.start()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        timer.stop()
        losses.append(loss.detach())
    times = timer.milliseconds()
    timed = times[args.warmup:] or times
    result = {"loss": [l.item() for l in losses], "step_ms": times, "median_step_ms": statistics.median(timed)}
    del model, optimizer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def summarize(args, impls, runs):
    ref = runs[impls[0]]["loss"]
    rel = {impl: [abs(l - r) / abs(r) for l, r in zip(runs[impl]["loss"], ref)] for impl in impls[1:]}
    speedup = {impl: runs[impls[0]]["median_step_ms"] / runs[impl]["median_step_ms"] for impl in impls[1:]}
    return rel, speedup


def print_report(args, impls, check, runs, rel, speedup):
    print("forward check (no training):")
    for impl in impls:
        c = check[impl]
        print(f"  {impl:>10}: attention calls {c['attention_calls']}, logits rel diff vs {impls[0]} "
              f"{c['logits_rel_diff_vs_ref']:.3e}")
    head = "".join(f"{'loss ' + i:>16}" for i in impls) + "".join(f"{'rel ' + i:>14}" for i in impls[1:])
    print(f"\n{'step':>6}{head}")
    shown = sorted({s for s in range(args.every - 1, args.steps, args.every)} | {0, args.steps - 1})
    for s in shown:
        row = "".join(f"{runs[i]['loss'][s]:>16.5f}" for i in impls) + "".join(f"{rel[i][s]:>14.2e}" for i in impls[1:])
        print(f"{s + 1:>6}{row}")
    timed = f"steps after the first {args.warmup}" if args.steps > args.warmup else "all steps"
    print(f"\nmedian step time ({timed}):")
    for impl in impls:
        extra = f"  speedup vs {impls[0]} {speedup[impl]:.3f}x" if impl in speedup else ""
        print(f"  {impl:>10}: {runs[impl]['median_step_ms']:.2f} ms{extra}")
    for impl in impls[1:]:
        print(f"max rel loss diff {impl} vs {impls[0]}: {max(rel[impl]):.3e} (tolerance {args.tolerance})")


def main(argv=None):
    args = parse_args(argv)
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    if "flash" in args.register_name:
        sys.exit(f"--register-name {args.register_name!r}: transformers would take it for a flash-attention kernel")
    if "flashgen" in impls:
        import flashgen.torch as ft
        args.register_name = ft.register_transformers(name=args.register_name)
    batches = make_batches(args)
    initial_state = {k: v.clone() for k, v in build_model(args, impls[0]).state_dict().items()}
    check = check_forward(args, impls, initial_state, batches[0][:1])
    runs = {impl: train(args, impl, initial_state, batches) for impl in impls}
    rel, speedup = summarize(args, impls, runs)
    print_report(args, impls, check, runs, rel, speedup)

    failures = [f"{i}: attention function called {check[i]['attention_calls']} times, expected {args.layers}"
                for i in impls if check[i]["attention_calls"] not in (None, args.layers)]
    failures += [f"{i}: logits rel diff {check[i]['logits_rel_diff_vs_ref']:.3e} > {args.logits_tolerance}"
                 for i in impls if check[i]["logits_rel_diff_vs_ref"] > args.logits_tolerance]
    failures += [f"{i}: max rel loss diff {max(rel[i]):.3e} > {args.tolerance}"
                 for i in impls[1:] if max(rel[i]) > args.tolerance]
    if args.json:
        env = {"torch": torch.__version__, "transformers": transformers.__version__,
               "device": torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else "cpu"}
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "env": env, "forward_check": check, "runs": runs,
                       "rel_loss_diff": rel, "speedup_vs_ref": speedup, "failures": failures}, f, indent=2)
    for failure in failures:
        print("FAIL", failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
