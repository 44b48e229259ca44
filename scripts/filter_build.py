"""Keep only some artifacts of a build directory (for packing GPU runs under the device
tool's 64 MiB): those whose artifact id contains TEXT, or (with --not) does not. The other
files are deleted and manifest.json is rewritten.

    python3 scripts/filter_build.py DIR TEXT [--not]
"""
import json
import os
import sys


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    d, text = sys.argv[1], sys.argv[2]
    invert = "--not" in sys.argv[3:]
    path = os.path.join(d, "manifest.json")
    with open(path) as fh:
        m = json.load(fh)
    keep, drop = [], []
    for a in m["artifacts"]:
        (keep if (text in a["artifact_id"]) != invert else drop).append(a)
    for a in drop:
        os.remove(os.path.join(d, a["file"]))
    m["artifacts"] = keep
    with open(path, "w") as fh:
        json.dump(m, fh, indent=2)
    print(f"{d}: kept {len(keep)} artifacts, removed {len(drop)}")


if __name__ == "__main__":
    main()
