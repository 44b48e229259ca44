"""The docs/perf.md table (and the ratio summary) from bench/compare_gpu.py's --json output.

    python3 bench/gpu_table.py docs/data/gpu_bench_h100_2026-11-24.json
"""
import json
import sys

ANCHORS = (("fa4", "FA4"), ("cudnn", "cuDNN"), ("flash", "FA2 (torch flash)"), ("triton", "Triton"))


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "docs/data/gpu_bench_h100_2026-11-24.json"
    with open(path) as fh:
        data = json.load(fh)
    print(f"device: {data['device']}\n")
    head = " | ".join(n for _, n in ANCHORS)
    ratios_head = " | ".join(f"ejc/{n.split(' ')[0]}" for _, n in ANCHORS)
    print(f"| d | variant | seq | b × h (kv) | ejc TFLOP/s | {head} | ejc/best | {ratios_head} | ejc config | rel_err |")
    print("|---|---|---|---|---|" + "---|" * len(ANCHORS) + "---|" + "---|" * len(ANCHORS) + "---|---|")
    ratios = {k: [] for k, _ in ANCHORS}
    best_ratios = []
    for r in data["rows"]:
        if "ejc" not in r:
            continue
        variant = r.get("variant", "causal" if r["causal"] else "full")
        rs = {}
        for k, _ in ANCHORS:
            if k in r:
                rs[k] = r["ejc"] / r[k]
                ratios[k].append(rs[k])
        best = [r[k] for k in ("fa4", "cudnn") if k in r]
        best_r = r["ejc"] / max(best) if best else None
        if best_r is not None:
            best_ratios.append(best_r)
        cfg = r["ejc_config"].split("@")
        tiling = cfg[0].rsplit("_", 2)[-2:]
        config = f"{tiling[0][1:]}x{tiling[1][1:]} {cfg[1].replace('ptx:', '').replace('/', ' ')}"
        err = f"{r['ejc_err']:.1e}" if r.get("ejc_err") is not None else "-"
        cells = " | ".join(f"{r[k]:.0f}" if k in r else "-" for k, _ in ANCHORS)
        rcells = " | ".join(f"{rs[k]:.2f}" if k in rs else "-" for k, _ in ANCHORS)
        best_s = f"**{best_r:.2f}**" if best_r is not None else "-"
        print(
            f"| {r['d']} | {variant} | {r['s']} | {r['b']} × {r['h']} ({r.get('hkv', r['h'])}) | {r['ejc']:.0f} | {cells} | "
            f"{best_s} | {rcells} | {config} | {err} |"
        )
    print()
    if best_ratios:
        below = sum(x < 1.0 for x in best_ratios)
        print(f"ejc/best of FA4 and cuDNN: {min(best_ratios):.2f}-{max(best_ratios):.2f}x, "
              f"{len(best_ratios) - below} of {len(best_ratios)} rows >= 1.0")
    for k, name in ANCHORS:
        xs = ratios[k]
        if xs:
            below = sum(x < 1.0 for x in xs)
            print(f"ejc/{name}: {min(xs):.2f}-{max(xs):.2f}x, {len(xs) - below} of {len(xs)} rows >= 1.0")


if __name__ == "__main__":
    main()
