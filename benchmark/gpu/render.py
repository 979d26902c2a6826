"""Markdown tables from the GPU benchmarks' JSON results (fetched from the device machine).

    python -m benchmark.gpu.render DIR      # DIR holds kernels, transition, kv_vmm, w4_variants .json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results" / "gpu"


def main() -> None:
    from benchmark.gpu import kernels, kv_vmm, transition, w4_variants

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    args = ap.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    for name, module in (("kernels", kernels), ("transition", transition), ("kv_vmm", kv_vmm),
                         ("w4_variants", w4_variants)):
        path = args.src / f"{name}.json"
        if not path.exists():
            print(f"{path} missing: skipped")
            continue
        result = json.loads(path.read_text())
        (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
        (RESULTS / f"{name}.md").write_text(module.markdown(result))
        print(f"wrote {RESULTS / name}.{{json,md}}")


if __name__ == "__main__":
    main()
