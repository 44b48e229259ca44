"""The docs/perf.md table (and the ratio summary) from bench/compare_gpu.py's --json output.

    python3 bench/gpu_table.py docs/data/gpu_bench_h100_2026-11-24.json
"""
import json
import sys


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "docs/data/gpu_bench_h100_2026-11-24.json"
    with open(path) as fh:
        data = json.load(fh)
    print(f"device: {data['device']}\n")
    print("| d | causal | seq | b × h | ejc TFLOP/s | cuDNN | FA2 (torch flash) | Triton | ejc/cuDNN | ejc/FA2 | ejc/Triton | ejc config | rel_err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    ratios = {"cudnn": [], "flash": [], "triton": []}
    for r in data["rows"]:
        if "ejc" not in r:
            continue
        rs = {}
        for k in ratios:
            if k in r:
                rs[k] = r["ejc"] / r[k]
                ratios[k].append(rs[k])
        cfg = r["ejc_config"].split("@")
        tiling = cfg[0].rsplit("_", 2)[-2:]
        config = f"{tiling[0][1:]}x{tiling[1][1:]} {cfg[1].replace('ptx:', '').replace('/', ' ')}"
        err = f"{r['ejc_err']:.1e}" if r.get("ejc_err") is not None else "-"
        print(
            f"| {r['d']} | {int(r['causal'])} | {r['s']} | {r['b']} × {r['h']} | {r['ejc']:.0f} | {r.get('cudnn', 0):.0f} | "
            f"{r.get('flash', 0):.0f} | {r.get('triton', 0):.0f} | {rs.get('cudnn', 0):.2f} | {rs.get('flash', 0):.2f} | "
            f"{rs.get('triton', 0):.2f} | {config} | {err} |"
        )
    print()
    for k, name in (("flash", "FA2"), ("triton", "Triton"), ("cudnn", "cuDNN")):
        xs = ratios[k]
        if xs:
            below = sum(x < 1.0 for x in xs)
            print(f"ejc/{name}: {min(xs):.2f}-{max(xs):.2f}x, {len(xs) - below} of {len(xs)} rows >= 1.0")


if __name__ == "__main__":
    main()
