"""Write BENCHMARKS.md from a `flashgen bench --json` file (and its --plot image).

    flashgen bench --json docs/bench_h200.json --plot docs/bench_h200.png     # on the GPU
    python tools/bench_report.py docs/bench_h200.json > BENCHMARKS.md
"""
import json
import sys
from collections import defaultdict

IMPLS = ["flashgen", "sdpa-efficient", "sdpa-flash", "sdpa-cudnn"]


def main(path: str) -> None:
    data = json.load(open(path))
    cells = defaultdict(dict)
    for r in data["results"]:
        p = r["point"]
        key = (r["direction"], p["dtype"], p["head_dim"], p["causal"], p["seqlen"], p["batch"], p["heads"])
        cells[key][r["impl"]] = r["tflops"]
    print(f"""# Benchmarks

Device: **{data['device']}**. Command (one run, all implementations side by side):

```sh
flashgen build --arch sm90 --out build/kernels
FLASHGEN_KERNEL_PATH=build/kernels flashgen bench --json docs/bench_h200.json --plot docs/bench_h200.png --repeats 15
python tools/bench_report.py docs/bench_h200.json > BENCHMARKS.md
```

TFLOP/s, FlashAttention's convention: forward 4·B·H·M·N·D (halved for causal),
backward 2.5x that. Hidden 2048 (16 or 32 heads), batch x seqlen = 16k. Median
of 15 CUDA-event timings after 3 warm-ups, three input sets in turn. flashgen's
backward is timed without autograd; torch SDPA's backends through
`torch.autograd.grad` on one retained forward graph. Timings include each
call's host work (flashgen's Python, torch's dispatcher): at short sequences
that is part of the cost a user pays.

![TFLOP/s vs seqlen](docs/bench_h200.png)
""")
    for direction in ("fwd", "bwd"):
        print(f"\n## {'Forward' if direction == 'fwd' else 'Backward'}\n")
        print("| dtype | hdim | causal | B x S | " + " | ".join(IMPLS) + " | flashgen / efficient |")
        print("|---" * (5 + len(IMPLS)) + "|")
        for key in sorted(k for k in cells if k[0] == direction):
            _, dtype, hd, causal, s, b, h = key
            got = cells[key]
            vals = " | ".join(f"{got[i]:.0f}" if got.get(i) else "-" for i in IMPLS)
            ratio = got["flashgen"] / got["sdpa-efficient"] if got.get("flashgen") and got.get("sdpa-efficient") else None
            print(f"| {dtype} | {hd} | {'yes' if causal else 'no'} | {b} x {s} | {vals} | "
                  f"{f'{ratio:.2f}' if ratio else '-'} |")
    print("\n## Per-call host overhead (tiny problem, mean over 2000 calls)\n")
    for name, us in data["overhead_us"].items():
        print(f"- {name}: {us:.1f} us")


if __name__ == "__main__":
    main(sys.argv[1])
